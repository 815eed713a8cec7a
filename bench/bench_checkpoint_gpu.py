"""What a checkpoint adds to a CUDA training step, against the physical limits, in one run.

    .venv-torch/bin/python bench/bench_checkpoint_gpu.py [--params 0.8e9] [--width 4096] [--batch 2048]
        [--window 10] [--pairs 3] [--dir DIR] [--skip-dcp]

Model: a stack of ``nn.Linear(width, width)`` layers with ReLU (``--params`` parameters, default
0.8 B: 48 layers of 4096), float32, AdamW: parameters + two moments = 12 bytes a parameter, about
9.7 GB of state for 0.8 B. Batch ``--batch`` of random inputs, mean-square loss, TF32 matmuls.

Measured in this one run, on this GPU:

1. Physical limits: ``d2d_s``, a device-to-device copy of the whole state into spare device
   buffers; ``d2h_s``, a copy of the state into page-locked (pinned) host buffers, and its
   bandwidth (state bytes / seconds). Best of 3 each.
2. Added step time per save, by paired windows (bench/paired.py's method): windows of
   ``--window`` steps alternate without and with one save (after the window's first step); each
   saving window minus the window before it is what that save added to training (GPU work
   included: the window ends with ``torch.cuda.synchronize()``). The background write to disk is
   waited for between pairs, outside the windows. For our :class:`TorchCheckpointer` with
   ``snapshot_mode="pinned"`` (copies into reused pinned buffers on a side stream; only the next
   ``optimizer.step`` waits) and ``"device"`` (device-to-device into reused spare GPU buffers, the
   drain to host on the side stream during the next steps); the first save of each mode (buffer
   allocation, once per run) is reported on its own.
3. ``torch.distributed.checkpoint.async_save`` (world size 1, gloo/NCCL): the time the call holds
   the training thread (its stall), and its added window time measured the same way.

Goals (docs/training-pytorch.md): device mode adds <= 4x ``d2d_s`` per save; pinned mode adds <=
``d2h_s``. Without a CUDA device it prints that it found none and exits 0. Prints progress (flushed)
and a LAST LINE of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_DEVICE_X_D2D = 4.0


def log(message: str) -> None:
    """Print ``message`` and flush (progress survives a killed run).

    Args:
        message: the line.
    """
    print(message, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the benchmark's command line (``--help`` lists it).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        the parsed namespace.

    Raises:
        SystemExit: 2 for a bad option.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=0.8e9, help="model parameters (default 0.8e9)")
    parser.add_argument("--width", type=int, default=4096, help="features of each Linear layer (default 4096)")
    parser.add_argument("--batch", type=int, default=2048, help="rows per step (default 2048)")
    parser.add_argument("--window", type=int, default=10, help="steps per measuring window (default 10)")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of windows per method (default 3)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint scratch directory (default: a temp dir)")
    parser.add_argument("--skip-dcp", action="store_true", help="leave out torch.distributed.checkpoint.async_save")
    args = parser.parse_args(argv)
    for name in ("width", "batch", "window", "pairs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.params < args.width * args.width:
        parser.error(f"--params must be at least one layer ({args.width}^2), got {args.params:g}")
    return args


def main(argv=None) -> int:
    """Measure what a checkpoint adds to a CUDA training step (module docstring); the last line printed is JSON.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 (also when no CUDA device is found: then nothing is measured).
    """
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        log("no CUDA device found (torch.cuda.is_available() is False): nothing measured")
        log(json.dumps({"cuda": False, "skipped": "no CUDA device", "torch_version": torch.__version__}))
        return 0

    from spot_training.training.notice import NoticeHandler
    from spot_training.training.torch_adapter import TorchCheckpointer

    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    layers = max(1, round(args.params / (args.width * args.width)))
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="bench-ckpt-gpu-"))
    scratch.mkdir(parents=True, exist_ok=True)
    log(f"device {torch.cuda.get_device_name(device)}; building {layers} x Linear({args.width}, {args.width})")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(args.width, args.width, bias=False), torch.nn.ReLU())])
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, args.width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    state = [p.detach() for p in model.parameters()]
    state += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda]
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    log(f"{params / 1e9:.3f} B parameters, AdamW state on the GPU {state_bytes / 1e9:.2f} GB")

    # 1. Physical limits.
    def best_of(fn, n=3) -> float:
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return min(times)

    spare = [torch.empty_like(t) for t in state]
    d2d_s = best_of(lambda: [s.copy_(t, non_blocking=True) for s, t in zip(spare, state)])
    del spare
    torch.cuda.empty_cache()
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state]
    d2h_s = best_of(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(pinned, state)])
    del pinned
    log(f"limits: device-to-device copy of the state {d2d_s:.4f} s; pinned device-to-host {d2h_s:.4f} s "
        f"({state_bytes / d2h_s / 1e9:.1f} GB/s)")

    def window(save=None) -> tuple[float, float]:
        """Seconds of ``args.window`` steps (the save after the first), and the save call's seconds."""
        torch.cuda.synchronize()
        started = time.perf_counter()
        held = 0.0
        for i in range(args.window):
            step()
            if i == 0 and save is not None:
                t0 = time.perf_counter()
                save()
                held = time.perf_counter() - t0
        torch.cuda.synchronize()
        return time.perf_counter() - started, held

    quiet = NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())
    results: dict = {}
    base_windows: list[float] = []

    def paired_windows(label: str, save, wait) -> tuple[dict, list[float]]:
        """``args.pairs`` pairs of windows, without and with one ``save`` (our checkpointer's and
        DCP's alike); ``wait()`` returns the seconds the write still needed after the saving window.
        Returns the added seconds per save and the save call's seconds, and the waits."""
        extra, held, waits = [], [], []
        for pair in range(args.pairs):
            without, _ = window()
            with_save, h = window(save)
            waits.append(wait())
            extra.append(with_save - without)
            held.append(h)
            base_windows.append(without)
            log(f"{label}: pair {pair + 1}/{args.pairs}: window {without:.4f} s, with a save {with_save:.4f} s "
                f"(+{with_save - without:.4f} s; save call held {h:.4f} s; write waited {waits[-1]:.1f} s more)")
        return {"added_s_per_save": statistics.mean(extra), "added_s": extra,
                "save_call_s": statistics.mean(held)}, waits

    def measure_ours(mode: str) -> dict:
        directory = scratch / mode
        ckpt = TorchCheckpointer(model, optimizer, checkpoint_dir=directory, every_steps=None, every_seconds=None,
                                 background=True, keep=2, snapshot_mode=mode, notices=quiet)
        driver = ckpt.driver
        counter = [0]

        def save() -> None:
            counter[0] += 1
            driver.step = counter[0]
            driver.save()

        try:
            first_window, first_held = window(save)
            started = time.perf_counter()
            driver.wait()
            first_write = time.perf_counter() - started
            def wait() -> float:
                started = time.perf_counter()
                driver.wait()
                return time.perf_counter() - started

            found, writes = paired_windows(mode, save, wait)
            return {**found, "first_save_call_s": first_held, "first_window_s": first_window,
                    "first_write_wait_s": first_write, "write_wait_after_window_s": writes,
                    "mode_used": ckpt.adapter.mode}
        finally:
            ckpt.close()
            shutil.rmtree(directory, ignore_errors=True)
            torch.cuda.empty_cache()

    def measure_dcp() -> dict:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        pending = []

        def dcp_save() -> None:
            # DCP's documented way: state dicts with fully qualified names, then async_save.
            model_sd, optim_sd = get_state_dict(model, optimizer)
            pending.append(dcp.async_save({"model": model_sd, "optimizer": optim_sd},
                                          checkpoint_id=str(scratch / f"dcp-{len(pending)}")))

        def dcp_wait() -> float:
            started = time.perf_counter()
            while pending:
                future = pending.pop()
                getattr(future, "upload_completion", future).result()
            for p in scratch.glob("dcp-*"):
                shutil.rmtree(p, ignore_errors=True)
            return time.perf_counter() - started

        try:
            first_window, first_held = window(dcp_save)
            dcp_wait()
            found, _waits = paired_windows("dcp async_save", dcp_save, dcp_wait)
            return {**found, "first_save_call_s": first_held, "first_window_s": first_window}
        finally:
            dist.destroy_process_group()

    methods = [("pinned", lambda: measure_ours("pinned")), ("device", lambda: measure_ours("device"))]
    if not args.skip_dcp:
        methods.append(("dcp_async_save", measure_dcp))
    for name, measure in methods:
        try:
            results[name] = measure()
        except Exception as err:  # one method failing must not lose the others' figures
            log(f"{name}: failed: {err!r}")
            results[name] = {"error": repr(err)}
            torch.cuda.empty_cache()

    step_s = statistics.mean(base_windows) / args.window if base_windows else None
    added = {name: r.get("added_s_per_save") for name, r in results.items()}
    goals = {"device_added_s_max": GOAL_DEVICE_X_D2D * d2d_s, "pinned_added_s_max": d2h_s,
             "device_within_4x_d2d": added.get("device") is not None and added["device"] <= GOAL_DEVICE_X_D2D * d2d_s,
             "pinned_within_d2h": added.get("pinned") is not None and added["pinned"] <= d2h_s}
    if added.get("dcp_async_save") is not None and added.get("device") is not None:
        goals["dcp_over_device_ratio"] = added["dcp_async_save"] / max(added["device"], 1e-9)
    log(f"step {step_s * 1000 if step_s else float('nan'):.1f} ms; added per save (s): "
        + ", ".join(f"{name} {value:.4f}" if value is not None else f"{name} failed" for name, value in added.items())
        + f"; goals: device <= 4 x d2d = {GOAL_DEVICE_X_D2D * d2d_s:.4f} s, pinned <= d2h = {d2h_s:.4f} s")
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    log(json.dumps({"cuda": True, "device": torch.cuda.get_device_name(device), "torch_version": torch.__version__,
                    "parameters": params, "state_bytes": state_bytes, "layers": layers, "width": args.width,
                    "batch": args.batch, "window_steps": args.window, "pairs": args.pairs, "step_s": step_s,
                    "limits": {"d2d_s": d2d_s, "d2h_pinned_s": d2h_s, "d2h_pinned_gb_s": state_bytes / d2h_s / 1e9},
                    "results": results, "goals": goals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
