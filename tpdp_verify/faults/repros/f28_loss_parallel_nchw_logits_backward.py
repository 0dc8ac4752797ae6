"""Fault 28 (torch 2.13.0): loss_parallel cross entropy over (N, C, H, W) logits gives a wrong gradient or raises.

Under loss_parallel(), F.cross_entropy over vocab-sharded 4-D logits (a per-pixel classifier's
N, C, H, W; C sharded) computes the right loss, but its backward is wrong: torch/distributed/
tensor/parallel/loss.py:_nll_loss_and_log_softmax_backward (nll_loss2d_backward's handler) lays
the gradient out as grad_input.transpose(1, -1), i.e. (N, W, H, C), flattens it, and puts each
pixel's -1 at the row of the target flattened in (N, H, W) order, so with H, W > 1 the -1s land
on the wrong pixels; and it returns that transposed, non-contiguous local tensor in a DTensor
whose spec declares contiguous strides. Logits that are a leaf get a wrong gradient, silently;
logits made by a view (a [seq, vocab] sample's x.transpose(0, 1).unsqueeze(0).unflatten(2, (H, W)))
raise RuntimeError "view size is not compatible with input tensor's size and stride" in the view's
backward (aten.view on that local tensor, in torch/distributed/tensor/_dispatch.py). reduction
"mean" and "none", and class weights, go the same way. (N, C, D) logits, and (N, C, H, W) ones
flattened to (N, C, H*W) before the loss, train like one device (checked too). 2 ranks, a (tp=2)
mesh. Run: python f28_loss_parallel_nchw_logits_backward.py
"""

import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
SEQ, CLASSES, H, W = 6, 4, 2, 3  # a sample's SEQ = H * W positions, each over CLASSES classes
CASES = {  # name: (the leaf's shape, logits made from the leaf, the target's shape)
    "(N, C, H, W) leaf": ((1, CLASSES, H, W), lambda x: x, (1, H, W)),
    "(N, C, H, W) from [seq, vocab] by unflatten": ((SEQ, CLASSES), lambda x: ncd(x).unflatten(2, (H, W)), (1, H, W)),
    "(N, C, H*W) from [seq, vocab]": ((SEQ, CLASSES), lambda x: ncd(x), (1, SEQ)),
}
FAULT = "view size is not compatible"


def ncd(x: torch.Tensor) -> torch.Tensor:
    """A [seq, vocab] sample's logits as cross entropy's (N=1, C=vocab, D=seq)."""
    return x.transpose(0, 1).unsqueeze(0)


def inputs(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape, _, target_shape = CASES[case]
    gen = torch.Generator().manual_seed(0)
    leaf = torch.randn(SEQ, CLASSES, generator=gen, dtype=torch.float64)  # one sample's logits
    target = torch.randint(0, CLASSES, (SEQ,), generator=gen)
    if len(shape) == 4:  # the same logits, laid out (N, C, H, W) and contiguous
        leaf = ncd(leaf).reshape(shape).contiguous()
    return leaf, target.view(target_shape)


def one_device(case: str) -> tuple[float, torch.Tensor]:
    leaf, target = inputs(case)
    leaf.requires_grad_()
    loss = F.cross_entropy(CASES[case][1](leaf), target, reduction="sum")
    loss.backward()
    return loss.item(), leaf.grad


def on_rank(rank: int) -> dict:
    """{case: (loss, the leaf's gradient or the fault's message)}, each computed under loss_parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    out = {}
    for case, (_, logits_of, _) in CASES.items():
        leaf, target = inputs(case)
        leaf = distribute_tensor(leaf, mesh, [Shard(1)]).requires_grad_()  # vocab-sharded, as ColwiseParallel's
        with loss_parallel():
            loss = F.cross_entropy(logits_of(leaf), target, reduction="sum").full_tensor()
            try:  # every rank raises at the same point, before any collective of the backward
                loss.backward()
            except RuntimeError as exc:
                if FAULT not in str(exc):
                    raise
                out[case] = (loss.item(), f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
        out[case] = (loss.item(), leaf.grad.full_tensor().tolist())  # plain values for the queue
    return out


def main() -> int:
    expected = {case: one_device(case) for case in CASES}
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    said, present = [], False
    for case, (loss, grad) in expected.items():
        got = [v[case] for _, v in results.values()]
        loss_diff = max(abs(g[0] - loss) for g in got)
        if isinstance(got[0][1], str):
            said.append(f"{case}: loss off by {loss_diff:.3g}, then the backward raised {got[0][1]} (on every rank)")
            present = True
            continue
        diff = max((torch.tensor(g[1], dtype=grad.dtype) - grad).abs().max().item() for g in got)
        said.append(f"{case}: loss off by {loss_diff:.3g}, gradient off by {diff:.3g}")
        present |= max(loss_diff, diff) > 1e-12
    print(f"expected: F.cross_entropy(reduction='sum') over {CLASSES} classes at {H}x{W} positions: "
          + "; ".join(f"{case}: loss {loss:.6f}" for case, (loss, _) in expected.items())
          + ", and its gradient (one device)")
    print(f"actual:   under loss_parallel on {WORLD} tp ranks: {'; '.join(said)}")
    print("fault present" if present else "fault absent")
    return int(present)


# --- boilerplate: WORLD gloo ranks on 127.0.0.1, each answering once; a timeout for hangs ------

def rank_main(rank, port, answers):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on loopback too
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        answers.put((rank, "ok", on_rank(rank)))
    except Exception:
        answers.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def run_ranks() -> dict:
    """{rank: (status, value)}: status ok, error (a bug in this script), hung or aborted."""
    # forkserver: torch and the distributed packages the reproductions use imported once, by the
    # server the ranks are forked from (spawn imports them in each rank: seconds of CPU a rank)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor.parallel",
                                "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo"])
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, on loopback only
    port = listener.getsockname()[1]
    # The ranks' rendezvous, hosted here on the listener so that it listens on loopback only.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        while not answers.empty():
            rank, status, value = answers.get()
            results[rank] = (status, value)
            if status != "ok":  # the others may wait for this rank: give them a grace only
                deadline = min(deadline, monotonic() + GRACE_S)
        for r, p in enumerate(procs):
            if r not in results and p.exitcode not in (None, 0) and answers.empty():
                results[r] = ("aborted", p.exitcode)
        sleep(0.05)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    del store  # kept until every rank is done with it
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def bail_out(results) -> int | None:
    """2 when a rank failed in a way that is not this fault (what each said, to stderr), else None.

    This fault neither raises out of on_rank nor hangs nor aborts a rank: any of those is
    a bug in this script or another fault.
    """
    failed = {r: (s, v) for r, (s, v) in results.items() if s != "ok"}
    for r, (status, value) in failed.items():
        detail = {"error": f":\n{value}", "aborted": f" (exit code {value})"}.get(status, "")
        print(f"rank {r} {status}{detail}", file=sys.stderr)
    return 2 if failed else None


if __name__ == "__main__":
    sys.exit(main())
