"""A patched model under DistributedDataParallel: two CPU processes over gloo train exactly as one
process does on the whole batch (DDP averages the shard gradients). brrr holds no per-process
state, so nothing in the user's distributed code changes."""

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import brrr
from helpers import cpu_kernels
from test_registry import TinyGPT, perturb

STEPS, WORLD = 3, 2


def build(style):
    torch.manual_seed(0)
    model = TinyGPT(style)
    perturb(model)
    report = brrr.patch(model)
    assert report.swapped
    return model


def train(model, tokens):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _worker(rank, style, init_file, tokens, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    cpu_kernels()  # brrr's CPU code, as in the test's own process (conftest's fixture does not run here)
    try:
        model = build(style)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        losses = train(ddp, tokens.chunk(WORLD)[rank])
        if rank == 0:
            torch.save({"state": model.state_dict(), "losses": losses}, out_file)
        dist.barrier()  # neither rank tears the group down while the other still uses it
    except BaseException:
        # Written before the teardown, which can abort the process (gloo) and lose the traceback.
        with open(f"{out_file}.rank{rank}.error", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("style", ["llama", "gelu"])
def test_ddp_over_gloo_matches_one_process(style, tmp_path):
    tokens = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    out_file = str(tmp_path / "rank0.pt")
    try:
        mp.spawn(_worker, args=(style, str(tmp_path / "init"), tokens, out_file), nprocs=WORLD, join=True)
    except mp.ProcessExitedException:
        errors = "".join(p.read_text() for p in sorted(tmp_path.glob("rank0.pt.rank*.error")))
        pytest.fail(f"a worker died; its error, if it wrote one:\n{errors or '(none written)'}")
    result = torch.load(out_file)
    single = build(style)
    single_losses = train(single, tokens)
    # Rank 0's losses are of its shard only; the parameters after the steps must be the same.
    assert len(result["losses"]) == len(single_losses) == STEPS
    for name, value in single.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
