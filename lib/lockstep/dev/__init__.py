"""Developer tools: generators and checkers that people working on lockstep run (through `lockstep
dev ...` and the tests), never a pipeline stage. They write the committed reference files that
stages read as data (the eval sets, the hub-layout samples, the rehearsal preset, reference parity
artifacts) and keep dvc.yaml's code deps in step with the imports. No stage and no module outside
this package imports them (tests/test_dev_tools.py checks every stage's import closure), so an
edit here reruns nothing in the DAG."""
