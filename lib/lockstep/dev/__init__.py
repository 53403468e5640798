"""Developer tools: generators and checkers that people working on lockstep run (through `lockstep
dev ...` and the tests), never a pipeline stage. They write the committed reference files that
stages read as data (the eval sets, the hub-layout samples, the rehearsal preset, reference parity
artifacts) and keep dvc.yaml's code deps in step with the imports. No stage and no module outside
this package but the console script imports them (tests/test_dev_tools.py checks every stage's
import closure), so an edit here reruns nothing in the DAG.

- `dvcdeps`: dvc.yaml's code deps from codeid's scan (`lockstep dev deps [--write]`)
- `evalsets_build`: the eval sets under `evalsets/`, generated (`lockstep dev evalsets`)
- `own_eval_analysis`: an own eval task item by item, beside an untrained control (`lockstep dev own-eval`)
- `hub_samples`: the hub-layout samples under `corpus/hub/`, generated (`lockstep dev hub-samples`)
- `hub_samples_chat`: the chat benchmarks' hub-layout samples (ARC, MMLU, HumanEval), for `hub_samples`
- `rehearsal`: presets/rehearsal.yaml generated from d12.yaml and a size table (`lockstep dev rehearsal`)
- `parity_files`: parity artifacts written from plain lists, for tests and hand-made references
"""
