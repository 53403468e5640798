"""Sharded optimizer state (lockstep.train.optim.ShardedAdamW, ShardedMuon) on 2 and 4 gloo ranks: the
weights equal a one-process run's (bit for bit where the order of float sums is the same), each
rank holds about 1/world_size of the state, a NaN/inf step is skipped on every rank alike, and a
checkpoint resumes on another number of ranks (the state is resharded) or is refused with both
sizes named. The collectives are the real reduce_scatter_single / all_gather_single on gloo, the
ones NCCL runs on GPUs."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lockstep.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lockstep.train import resume
from lockstep.train.optim import (SHARD_ALIGN, OptimConfig, StateLayout, build_optimizers, matrix_owners, slice_ranges,
                                  state_layout)
from _gloo import free_port, gloo_rank
from lockstep.core.runtime import Runtime
from test_train import CPU, T, _cfg, _model, _trainer

META = {"stage": "test", "code_revision": "test"}


def _optim(clip: float) -> OptimConfig:
    # weight decay on, so the sharded AdamW's decay is compared too
    return OptimConfig(muon_momentum_warmup_steps=4, weight_decay=0.1, grad_clip=clip)


# 2T: one micro-batch per rank on 2 ranks, two in one process, summed in the same order (g0 + g1),
# so the 2-rank run can equal one process bit for bit. 4T: the 4-rank sum is gloo's order.
CFG2 = {"clip0": _cfg(batch_tokens=2 * T, device_batch_rows=1, num_steps=4, optim=_optim(0.0)),
        "clip": _cfg(batch_tokens=2 * T, device_batch_rows=1, num_steps=4, optim=_optim(0.1)),
        "skip": _cfg(batch_tokens=2 * T, device_batch_rows=1, num_steps=4, optim=_optim(0.0), nonfinite_patience=1)}
CFG4 = {"clip0": _cfg(batch_tokens=4 * T, device_batch_rows=1, num_steps=4, optim=_optim(0.0)),
        "clip": _cfg(batch_tokens=4 * T, device_batch_rows=1, num_steps=4, optim=_optim(0.1))}
# (name, config, sharded?, run folder to resume from or None, stop at step, inf gradient on rank 1)
RUNS = {
    2: [("clip0", CFG2["clip0"], None, None, None, False),
        ("clip", CFG2["clip"], None, None, None, False),
        ("replicated", CFG2["clip"], False, None, None, False),
        ("skip", CFG2["skip"], None, None, None, True),
        ("from_one", CFG2["clip0"], None, "one_stopped2", None, False),
        ("stopped2", CFG2["clip0"], None, "two_stopped2", 2, False),
        ("stopped4", CFG4["clip0"], None, "two_stopped4", 2, False)],
    4: [("clip0", CFG4["clip0"], None, None, None, False),
        ("clip", CFG4["clip"], None, None, None, False),
        ("replicated", CFG4["clip"], False, None, None, False),
        ("from_one", CFG4["clip0"], None, "one_stopped4", None, False),
        ("from_two", CFG4["clip0"], None, "two_stopped4_for4", None, False)],
}


def _state_bytes(optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes of optimizer state tensors (moments, momentum; not the 0-d step counts), by optimizer."""
    return {type(o).__name__.removeprefix("Sharded"): sum(t.numel() * t.element_size() for st in o.state.values()
                                                          for t in st.values() if torch.is_tensor(t) and t.ndim > 0)
            for o in optimizers}


def _inf_grad_on_step(model: torch.nn.Module, step: int) -> None:
    """Make lm_head's gradient infinite in optimizer step `step` (1-based; one pass per step)."""
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return grad + math.inf if calls[0] == step else grad

    model.lm_head.weight.register_hook(hook)


def _train(rt: Runtime, out: Path, name: str, cfg, sharded, run_dir, stop, inf_on_rank1) -> dict:
    model = _model()
    if inf_on_rank1 and rt.rank == 1:
        _inf_grad_on_step(model, 2)
    trainer = _trainer(model, cfg, rt, shard_optimizer=sharded)
    res = trainer.fit(out / (run_dir or f"w{rt.world_size}_{name}"), META, stop_at_step=stop)
    return {"state": model.state_dict(), "losses": res.losses, "bytes": _state_bytes(trainer.optimizers),
            "kinds": [type(o).__name__ for o in trainer.optimizers]}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    with gloo_rank(rank, world, port) as rt:
        results = {run[0]: _train(rt, Path(out), *run) for run in RUNS[world]}
        torch.save(results, Path(out) / f"w{world}_rank{rank}.pt")


def _one(cfg, run_dir: Path, *, stop: int | None = None, inf_step: int | None = None) -> dict:
    model = _model()
    if inf_step is not None:
        _inf_grad_on_step_all_passes(model, inf_step, passes=cfg.batch_tokens // T)
    trainer = _trainer(model, cfg, CPU)
    res = trainer.fit(run_dir, META, stop_at_step=stop)
    return {"state": model.state_dict(), "losses": res.losses, "bytes": _state_bytes(trainer.optimizers)}


def _inf_grad_on_step_all_passes(model: torch.nn.Module, step: int, *, passes: int) -> None:
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return grad + math.inf if (calls[0] - 1) // passes + 1 == step else grad

    model.lm_head.weight.register_hook(hook)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run the tests compare, once: one process, then 2 and 4 gloo ranks (fork), then the
    one-process resumes of the 2-rank checkpoints. One thread everywhere, as the ranks have."""
    out = tmp_path_factory.mktemp("sharded")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {"clip0_2": _one(CFG2["clip0"], out / "one_clip0_2"), "clip_2": _one(CFG2["clip"], out / "one_clip_2"),
               "skip_2": _one(CFG2["skip"], out / "one_skip_2", inf_step=2),
               "clip0_4": _one(CFG4["clip0"], out / "one_clip0_4"), "clip_4": _one(CFG4["clip"], out / "one_clip_4")}
        _one(CFG2["clip0"], out / "one_stopped2", stop=2)
        _one(CFG4["clip0"], out / "one_stopped4", stop=2)
        for world in (2, 4):
            if world == 4:
                shutil.copytree(out / "two_stopped4", out / "two_stopped4_for4")
            mp.start_processes(
                _worker, args=(world, free_port(), str(out)), nprocs=world, start_method="fork", join=True
            )
        one["from_two_2"] = _one(CFG2["clip0"], out / "two_stopped2")
        ranks = {w: [torch.load(out / f"w{w}_rank{r}.pt", weights_only=True) for r in range(w)] for w in (2, 4)}
    finally:
        torch.set_num_threads(threads)
    return {"one": one, "ranks": ranks, "out": out}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, skip: str = "") -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if k != skip)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """Equal to float rounding, as amplified in 4 steps: AdamW divides each element's momentum by
    its own RMS, so a token embedding row whose gradient is near zero turns a rounding-level
    difference into a visible one (measured: wte up to 1.0e-5 on weights of |w| <= 3; every
    other weight within 3e-7)."""
    wte, rest = (a["wte.weight"] - b["wte.weight"]).abs().max().item(), _max_diff(a, b, skip="wte.weight")
    print(f"{what}: max |w - w_one| = {wte:.3g} (wte), {rest:.3g} (the rest)")
    assert wte < 5e-5 and rest < 1e-6, what


def test_sharded_optim_is_the_default_under_torch_distributed(runs) -> None:
    for world in (2, 4):
        assert runs["ranks"][world][0]["clip0"]["kinds"] == ["ShardedAdamW", "ShardedMuon"]
        assert runs["ranks"][world][0]["replicated"]["kinds"] == ["AdamW", "Muon"]


def test_sharded_optim_two_ranks_equal_one_process(runs) -> None:
    one, two = runs["one"], runs["ranks"][2]
    for r in range(2):  # every rank ends with the same weights
        for name in ("clip0", "clip", "replicated", "skip"):
            assert _max_diff(two[r][name]["state"], two[0][name]["state"]) == 0, (r, name)
    # No clipping: same gradient sums, an elementwise AdamW on slices, the same Muon per matrix:
    # bit for bit.
    assert _max_diff(two[0]["clip0"]["state"], one["clip0_2"]["state"]) == 0
    assert two[0]["clip0"]["losses"] == one["clip0_2"]["losses"]
    # The replicated path all-reduces full gradients and clips with torch's norm: bit for bit too.
    assert _max_diff(two[0]["replicated"]["state"], one["clip_2"]["state"]) == 0
    # Clipping every step (clip 0.1): the sharded norm sums squared norms of slices over ranks in
    # fp64, torch's takes the fp32 norm of whole tensors' norms; the scales differ by float
    # rounding, so the weights differ at that level.
    assert two[0]["clip"]["state"]["wte.weight"].ne(one["clip_2"]["state"]["wte.weight"]).any()
    _assert_close(two[0]["clip"]["state"], one["clip_2"]["state"], "2 ranks, clipped")


def test_sharded_optim_four_ranks_equal_one_process(runs) -> None:
    one, four = runs["one"], runs["ranks"][4]
    for r in range(4):
        for name in ("clip0", "clip", "replicated"):
            assert _max_diff(four[r][name]["state"], four[0][name]["state"]) == 0, (r, name)
    # Four gradients are summed in gloo's order, not the one process's ((g0 + g1) + g2) + g3, so
    # equality is to float rounding, sharded or replicated.
    for name in ("clip0", "clip"):
        _assert_close(four[0][name]["state"], one[f"{name}_4"]["state"], f"4 ranks, {name}")
        for (s1, l1), (s4, l4) in zip(one[f"{name}_4"]["losses"], four[0][name]["losses"], strict=True):
            assert s1 == s4 and abs(l1 - l4) < 1e-6
    _assert_close(four[0]["replicated"]["state"], one["clip_4"]["state"], "4 ranks, replicated")


def test_sharded_optim_state_bytes_fall_with_world_size(runs) -> None:
    total = runs["one"]["clip0_4"]["bytes"]  # {"AdamW": ..., "Muon": ...} in one process
    model = _model()
    largest_matrix = max(4 * p.numel() for p in model.parameters() if p.ndim == 2)
    for world in (2, 4):
        per_rank = [runs["ranks"][world][r]["clip0"]["bytes"] for r in range(world)]
        print(f"{world} ranks: optimizer state bytes per rank {per_rank}, one process {total}")
        for kind in ("AdamW", "Muon"):
            assert sum(b[kind] for b in per_rank) == total[kind]  # each byte held once
        # AdamW: equal slices up to SHARD_ALIGN rounding (2 moments x fp32 per element)
        n_adamw = len(runs["ranks"][world][0]["clip0"]["state"])  # bound: one rounding per tensor
        assert max(b["AdamW"] for b in per_rank) <= total["AdamW"] / world + 8 * SHARD_ALIGN * n_adamw
        # Muon: whole matrices, balanced by size: within one matrix of an even split
        assert max(b["Muon"] for b in per_rank) <= total["Muon"] / world + largest_matrix
        replicated = runs["ranks"][world][0]["replicated"]["bytes"]
        assert replicated["AdamW"] == total["AdamW"]  # the replicated path: every rank holds all of AdamW's


def test_sharded_optim_skips_a_non_finite_step_on_every_rank(runs) -> None:
    # Rank 1 alone sees an infinite gradient in step 2 (the loss stays finite): the inf lands in
    # its owner's slice, the all-reduced norm carries it to every rank, every rank skips step 2.
    two, one = runs["ranks"][2], runs["one"]
    for r in range(2):
        assert [s for s, _ in two[r]["skip"]["losses"]] == [1, 3, 4]
    assert _max_diff(two[0]["skip"]["state"], one["skip_2"]["state"]) == 0
    assert [s for s, _ in one["skip_2"]["losses"]] == [1, 3, 4]


def test_sharded_optim_resumes_on_another_world_size(runs) -> None:
    one, two, four = runs["one"], runs["ranks"][2], runs["ranks"][4]
    out = runs["out"]
    # The checkpoints were written sharded by 2 ranks, and replicated by one process.
    meta = load_checkpoint(out / "two_stopped2" / "step_00000002").meta
    assert meta["world_size"] == 2 and meta["optimizer_state"] == "sharded"
    assert load_checkpoint(out / "one_stopped2" / "step_00000002").meta["optimizer_state"] == "replicated"
    # 1 process -> 2 ranks and 2 ranks -> 1 process: the state moves exactly, the steps are
    # bit-equal (see above), so the resumed runs equal the uninterrupted one bit for bit.
    assert [s for s, _ in two[0]["from_one"]["losses"]] == [3, 4]
    assert _max_diff(two[0]["from_one"]["state"], one["clip0_2"]["state"]) == 0
    assert [s for s, _ in one["from_two_2"]["losses"]] == [3, 4]
    assert _max_diff(one["from_two_2"]["state"], one["clip0_2"]["state"]) == 0
    # 1 process -> 4 ranks and 2 ranks -> 4 ranks: to float rounding (the 4-rank sums' order)
    for name in ("from_one", "from_two"):
        assert [s for s, _ in four[0][name]["losses"]] == [3, 4]
        _assert_close(four[0][name]["state"], one["clip0_4"]["state"], f"4 ranks resumed {name}")


def _full_states(seed: int = 0) -> tuple[torch.nn.Module, list[dict]]:
    """A model and its one-process optimizers' state dicts after 3 steps on random gradients."""
    model = _model()
    optimizers = build_optimizers(model, _optim(0.0), model_dim=model.config.n_embd)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for o in optimizers:
            o.step()
    return model, [o.state_dict() for o in optimizers]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_sharded_optim_state_layouts_split_and_join_exactly(world: int, sharded: bool) -> None:
    model, full = _full_states()
    one = [state_layout(o, 1) for o in build_optimizers(model, _optim(0.0), model_dim=model.config.n_embd)]
    for lay, sd in zip(one, full, strict=True):
        other = StateLayout(lay.optimizer, sharded, world, lay.shapes, lay.group_sizes)
        per_rank = [other.split(sd, r) for r in range(world)]
        joined = other.full(per_rank)
        assert joined["state"].keys() == sd["state"].keys()
        for i, st in sd["state"].items():
            for k, v in st.items():
                assert torch.equal(joined["state"][i][k], v), (lay.optimizer, i, k)
        # each rank's part loads into that rank's optimizer (built without a process group)
        for r in range(world):
            kw = dict(rank=r, world_size=world)
            m = _model()
            built = build_optimizers(m, _optim(0.0), model_dim=m.config.n_embd, sharded=sharded, **kw)
            target = built[0] if lay.optimizer == "adamw" else built[1]
            assert state_layout(target, world) == other
            target.load_state_dict(per_rank[r])
            if sharded and lay.optimizer == "muon":
                owners = matrix_owners(lay.shapes, world)
                assert len(target.state) == owners.count(r)


def test_sharded_optim_ownership_is_balanced() -> None:
    assert slice_ranges(10, 4) == [(0, 10), (10, 10), (10, 10), (10, 10)]  # tiny: one rank holds it
    ranges = slice_ranges(100_000, 3)
    assert ranges[0] == (0, 33_344) and ranges[-1][1] == 100_000 and all(lo % SHARD_ALIGN == 0 for lo, _ in ranges)
    # d20's block matrices on 8 ranks: 5 of each tall or wide one and 10 square ones each
    shapes = [(1280, 1280)] * 4 * 20 + [(5120, 1280)] * 20 + [(1280, 5120)] * 20
    owners = matrix_owners(shapes, 8)
    assert all(sum(owners[i] == r for i in range(len(shapes)) if shapes[i] == (1280, 1280)) == 10 for r in range(8))
    load = [sum(math.prod(s) for s, o in zip(shapes, owners) if o == r) for r in range(8)]
    assert max(load) == min(load)


def test_sharded_optim_refuses_state_that_does_not_fit(tmp_path) -> None:
    """A 2-rank checkpoint whose AdamW lost a param group (another model or config wrote it): the
    error names both world sizes and both ways forward."""
    model, full = _full_states()
    one = [state_layout(o, 1) for o in build_optimizers(model, _optim(0.0), model_dim=model.config.n_embd)]
    per_rank = []
    for r in range(2):
        states = [StateLayout(lay.optimizer, True, 2, lay.shapes, lay.group_sizes).split(sd, r)
                  for lay, sd in zip(one, full, strict=True)]
        states[0]["param_groups"] = states[0]["param_groups"][:1]
        per_rank.append({"optimizers": states})
    save_checkpoint(tmp_path / "run" / "step_00000002", model.state_dict(), dict(enumerate(per_rank)),
                    {**META, "step": 2, "world_size": 2, "optimizer_state": "sharded"})
    found = resume.find(tmp_path / "run", CPU)
    assert found is not None and found.world_size == 2
    optimizers = build_optimizers(_model(), _optim(0.0), model_dim=model.config.n_embd)
    with pytest.raises(
        CheckpointError,
        match=r"optimizer state of 2 rank\(s\) \(sharded\) that does not fit this run's "
        r"optimizers on 1 rank\(s\) \(replicated\).*runtime.nproc x runtime.nnodes = 2"
        r".*or delete .* to start fresh",
    ):
        resume.load(found, _model(), optimizers, CPU)


def test_sharded_optimizers_in_one_process_equal_the_replicated_ones() -> None:
    # What the GPU check's ls_shard phase checks on a GPU: sharded=True builds the sharded classes
    # even at world size 1 (their collectives are copies). Their updates change no bit; with
    # clipping, the sharded global norm sums squares in fp64 where clip_grad_norm_ takes the norm
    # of fp32 norms, so the clip factor, and then the weights, differ by rounding.
    runs = {}
    for clip in (0.0, 0.1):
        for sharded in (False, True):
            model = _model()
            trainer = _trainer(model, _cfg(num_steps=3, optim=_optim(clip)), CPU, shard_optimizer=sharded)
            for _ in range(3):
                trainer.step()
            runs[clip, sharded] = model.state_dict()
            kinds = [type(o).__name__ for o in trainer.optimizers]
            assert kinds == (["ShardedAdamW", "ShardedMuon"] if sharded else ["AdamW", "Muon"])
    for name, value in runs[0.0, False].items():
        assert torch.equal(runs[0.0, True][name], value), name
    _assert_close(runs[0.1, True], runs[0.1, False], "sharded in one process, clipped")
