"""bench/bench_gpu.py, the GPU check's benchmark, on CPU at toy sizes: its lockstep subcommands
drive the current Trainer and Engine (the check must not break when their APIs move), `compare`
computes its ratios from the records alone, the nanochat subcommands refuse without a checkout,
the stage commands come from dvc.yaml, and the decode fast path is taken only where the Engine
offers a switch. No timing is checked here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(out: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def test_ls_train_reference_and_fast_paths_run_the_trainer(bench, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--depth", "1", "--rows", "2", "--steps", "3", "--seq", "32", "--vocab", "256", "--compile", "off",
            "--peak-tflops", "0.1", "--dtype", "fp32"]  # declared peak: no matmul measurement
    bench.main(["ls_train", *tiny, "--kernels", "off"])
    bench.main(["ls_train", *tiny, "--kernels", "on"])
    ref, fast = _results(capsys.readouterr().out)
    assert (ref["kernels"], fast["kernels"]) == ("off", "on") and ref["phase"] == fast["phase"] == "ls_train"
    assert len(ref["losses"]) == 3 and ref["tok_per_s"] > 0 and ref["mfu"] > 0 and ref["host_peak_rss_gb"] > 0
    # same seed, same batches, fp32: the two paths agree to rounding (tests/test_speed_paths.py bounds it)
    assert fast["losses"] == pytest.approx(ref["losses"], rel=1e-4)


def test_ls_decode_measures_the_reference_and_the_fast_path(bench, capsys) -> None:
    bench.main(["ls_decode", "--depth", "1", "--vocab", "256", "--decode-seq", "64", "--new-tokens", "4", "--reps", "1",
                "--compile", "off"])
    (r,) = _results(capsys.readouterr().out)
    assert r["ref_b1_tok_s"] > 0 and r["ref_b8_tok_s"] > 0 and r["fast_b1_tok_s"] > 0 and r["fast_b8_tok_s"] > 0
    assert r["ref_recompiles"] == r["fast_recompiles"] == 0
    assert r["skipped"] == {"compiled": "--compile off"} and "compiled_b1_tok_s" not in r


def test_ls_decode_check_passes_on_a_correct_engine(bench, capsys) -> None:
    bench.main(["ls_decode_check", "--depth", "2", "--vocab", "256", "--decode-seq", "64", "--check-tokens", "8",
                "--compile", "off"])
    (r,) = _results(capsys.readouterr().out)
    assert r["ok"] and r["fp32_greedy_equal"] == r["fp32_sampled_equal"] == 8 and r["check_tokens"] == 8


def test_ls_head_and_ls_shard_run_and_agree(bench, capsys) -> None:
    tiny = ["--depth", "1", "--rows", "2", "--seq", "32", "--vocab", "256", "--compile", "off", "--dtype", "fp32"]
    bench.main(["ls_head", *tiny, "--reps", "1"])
    bench.main(["ls_shard", *tiny, "--steps", "2", "--kernels", "on"])
    head, shard = _results(capsys.readouterr().out)
    assert (
        head["reference_ms"] > 0 and head["chunked_ms"] > 0 and head["reference_extra_gb"] is None
    )  # CPU: not measured
    assert head["loss_rel_err"] < 1e-6 and head["dx_rel_err"] < 1e-5 and head["dw_rel_err"] < 1e-5
    assert shard["ok"] and shard["clip0_equal"] and shard["kinds"] == ["ShardedAdamW", "ShardedMuon"]


def test_warm_runs_print_no_result(bench, capsys) -> None:
    bench.main(["ls_train", "--depth", "1", "--rows", "2", "--steps", "3", "--seq", "32", "--vocab", "256",
                "--compile", "off", "--peak-tflops", "0.1", "--warm"])
    out = capsys.readouterr().out
    assert not _results(out) and json.loads(out.split("WARM ", 1)[1].splitlines()[0])["phase"] == "ls_train"


def test_nanochat_subcommands_refuse_without_a_checkout(bench, monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.delenv("NANOCHAT_ROOT", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.main(["nc_train", "--depth", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "NANOCHAT_ROOT is not set" in err and "92d63d4" in err and "ls_train" in err
    monkeypatch.setenv("NANOCHAT_ROOT", str(tmp_path))
    with pytest.raises(SystemExit):
        bench.main(["nc_decode"])
    assert "holds no nanochat/gpt.py" in capsys.readouterr().err


def test_compare_reads_ratios_from_the_records(bench, tmp_path: Path) -> None:
    common = {"depth": 12, "rows": 32, "seq": 2048, "accum": 1, "first_step_s": 30.0}
    records = [
        {"phase": "env", "gpu": "H100", "torch": "2.11", "cuda": "13.0", "matmul_n": 8192, "bf16_matmul_tflops": 800.0,
         "declared_bf16_tflops": 1000.0},
        {"phase": "ls_train", "kernels": "off", **common, "tok_per_s": 300, "mfu": 30.0, "peak_mem_gb": 40.0,
         "losses": [11.0, 10.0]},
        {"phase": "ls_train", "kernels": "on", **common, "tok_per_s": 450, "mfu": 45.0, "peak_mem_gb": 30.0,
         "losses": [11.0, 10.001]},
        {"phase": "nc_train", **common, "tok_per_s": 400, "mfu": 40.0, "peak_mem_gb": 32.0, "losses": [11.1, 10.2]},
        {"phase": "ls_decode", "depth": 12, "new_tokens": 200, "ref_b1_tok_s": 100.0, "ref_b8_tok_s": 800.0,
         "fast_b1_tok_s": 2000.0, "fast_b8_tok_s": 8000.0, "compiled_b1_tok_s": 2500.0, "compiled_b8_tok_s": 12000.0,
         "compiled_recompiles": 2, "skipped": {}},
        {"phase": "nc_decode", "depth": 12, "new_tokens": 200, "ref_b1_tok_s": 50.0, "ref_b8_tok_s": 400.0},
        {"phase": "ls_decode_check", "depth": 12, "check_tokens": 32, "tie_logits": 0.25, "fp32_greedy_equal": 32,
         "fp32_sampled_equal": 32, "bf16_greedy_equal": 20, "bf16_divergence_gap": 0.1, "ok": True},
        {"phase": "ls_shard", "depth": 12, "steps": 3, "clip0_equal": True, "clip1_max_abs_diff": 1e-7, "ok": True,
         "fast_paths": {"muon_compiled": {"path": "reference", "fell_back": "RuntimeError: boom"}}},
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines, ratios = bench.compare(bench.read_results(path))
    train = ratios["train_d12_32x2048x1"]
    assert train["reference/nanochat"] == {"tok_per_s": 0.75, "peak_mem": 1.25, "mfu": 0.75}
    assert train["fast/nanochat"] == {"tok_per_s": 1.125, "peak_mem": 0.9375, "mfu": 1.125}
    assert train["fast/reference"]["tok_per_s"] == 1.5 and train["fast/reference"]["max_loss_diff"] == pytest.approx(
        1e-3
    )
    assert ratios["decode_d12"]["b1"] == {"reference/nanochat": 2.0, "fast/nanochat": 40.0, "compiled/nanochat": 50.0,
                                          "fast/reference": 20.0, "compiled/reference": 25.0, "compiled/fast": 1.25}
    assert ratios["matmul_of_datasheet"] == 0.8 and ratios["decode_checks_ok"] and ratios["sharded_equal"]
    assert any("fast/reference" in line and "1.500x" in line for line in lines)
    assert any(line.startswith("decode checks (ok)") and "a tie within 0.1 logits" in line for line in lines)
    assert "RECOMPILED: ls_decode d12 compiled compiled 2 graph(s) while timed" in lines
    assert "FELL BACK: ls_shard d12: muon_compiled ran its reference path (RuntimeError: boom)" in lines
    # a log with RESULT lines reads the same as the jsonl
    log = tmp_path / "log.txt"
    log.write_text("step 1/2 | loss 11\n" + "".join("RESULT " + json.dumps(r) + "\n" for r in records))
    assert bench.compare(bench.read_results(log))[1] == ratios


def test_stage_commands_come_from_dvc_yaml(bench) -> None:
    import yaml

    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    for name, item in bench.STAGE_ORDER:
        cmd = bench.stage_command(dvc, name, item)
        assert cmd[1:3] == ["-m", f"stages.{name}"] and not any("${" in w for w in cmd)
    assert "data/ckpt/rl" in bench.stage_command(dvc, "eval", "rl")


def _check_model():
    from lockstep.model.gpt import GPT, GPTConfig

    return GPT.build(GPTConfig.from_depth(2, 256, 64), "cpu", seed=0).eval()


@pytest.mark.parametrize("fault", ["rotary one position ahead", "a row's prompt not copied into the cache"])
def test_decode_checks_report_a_fault_planted_in_the_static_cache(bench, monkeypatch, fault: str) -> None:
    from lockstep.infer.decode import StaticKVCache

    model, tok = bench.checkable_weights(_check_model()), bench.NoSpecials()
    assert bench.decode_checks(model, tok, tokens=12, compile_step=False)["ok"]
    if fault.startswith("rotary"):
        monkeypatch.setattr(StaticKVCache, "positions", lambda self: self.pos + 1)
    else:
        def stale(self, rows, source):  # the position moves, the keys and values stay what they were
            self.pos[rows.start:rows.stop] = source.row_positions()[0]

        monkeypatch.setattr(StaticKVCache, "put_rows", stale)
    checks = bench.decode_checks(model, tok, tokens=12, compile_step=False)
    assert not checks["ok"] and checks["fp32_greedy_equal"] < 12, checks
    # On the init weights every block is the identity on the residual stream (its output
    # projections are zero), so the same fault decodes the same tokens: the check could not fail.
    assert bench.decode_checks(_check_model(), tok, tokens=12, compile_step=False)["fp32_greedy_equal"] == 12


@pytest.mark.parametrize("depth", [12, 20])
def test_the_benchmarked_shape_is_the_presets(bench, depth: int) -> None:
    """ls_* and nc_* measure the model the d12/d20 presets train: heads of 128 (6 and 10), the
    preset's whole GPTConfig at its 65,536-id vocabulary."""
    import argparse

    import yaml

    from lockstep.train.trainer import ModelParams
    from stages._common import section

    p = yaml.safe_load((ROOT / "presets" / f"d{depth}.yaml").read_text())
    preset = section(p, "model", ModelParams).gpt_config(65536)
    a = argparse.Namespace(depth=depth, vocab=65536, head_dim=128)
    assert bench.n_heads(a) == preset.n_head == depth * 64 // 128
    assert bench.model_config(a, 2048) == preset
