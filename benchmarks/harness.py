"""A small benchmark harness: interleaved timing of step variants, and peak memory per variant.

Timing::

    from benchmarks.harness import compare, print_table
    results = compare({"plain": plain_step, "hooks": hooked_step}, rounds=30)
    print_table(results, baseline="plain", title="MLP 784-512-512-10, B=128")

Each method is a zero-argument callable doing one full training-step variant. All methods run
in the same process and are interleaved (round-robin: plain, hooks, plain, hooks, ...), so slow
drifts of the machine (other processes, frequency scaling) hit every method alike. Reported:
median and inter-quartile range in milliseconds, and the ratio to a baseline as the median over
rounds of the per-round ratio (robust to load that changes between rounds).

Memory::

    from benchmarks.harness import peak_memory
    report = peak_memory("benchmarks.run:make_methods", "hooks", kwargs={"model": "mlp784"})

runs ``make_methods(**kwargs)[method]`` in a fresh subprocess and reports its peak resident
memory above what the process held once the factory had returned (models and data built).
The factory must be importable (``module:function``) and return ``{name: callable}``.

Only the standard library and torch are used.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

import per_sample_hooks as psh

Method = Callable[[], object]


@dataclass
class Timing:
    """Per-call times of one method, in milliseconds, with the round each was taken in."""
    name: str
    samples: list[float]
    rounds: list[int]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> tuple[float, float]:
        """First and third quartile."""
        if len(self.samples) < 2:
            return self.median, self.median
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    def ratio_to(self, baseline: Timing) -> float:
        """Median over rounds of this method's time over the baseline's in the same round.

        Paired by round, so that load from other processes, which drifts slowly, cancels;
        the ratio of the two medians where the methods share no round.
        """
        base = dict(zip(baseline.rounds, baseline.samples))
        paired = [t / base[r] for r, t in zip(self.rounds, self.samples) if r in base]
        return statistics.median(paired) if paired else self.median / baseline.median


def _time_once(method: Method, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        method()
    return (time.perf_counter() - start) * 1e3 / repeat


def compare(methods: Mapping[str, Method], *, rounds: int = 30, warmup: int = 3,
            repeat: int | Mapping[str, int] = 1, every: Mapping[str, int] | None = None,
            budget_s: float | None = None, min_sample_ms: float | None = None
            ) -> dict[str, Timing]:
    """Time every method in interleaved rounds; returns ``{name: Timing}`` in input order.

    ``warmup`` untimed calls of each method come first (buffers, caches, lazy init).
    Each round times every method once, in turn; one sample is the mean over ``repeat``
    back-to-back calls (an int, or per method: use it for methods under ~1 ms).
    ``every={"loop": 5}`` times a slow method only in every 5th round (and at least once).
    ``min_sample_ms`` instead sets each method's ``repeat`` from its last warm-up call, so
    that one sample lasts at least that long (timer resolution and call jitter of fast methods).
    ``budget_s`` stops early, after at least 5 rounds, once that many seconds have passed.
    """
    every = dict(every or {})
    repeats = {n: (repeat if isinstance(repeat, int) else repeat.get(n, 1)) for n in methods}
    for name, method in methods.items():
        for _ in range(max(warmup, 1 if min_sample_ms else 0)):
            last_ms = _time_once(method, 1)
        if min_sample_ms:
            repeats[name] = max(repeats[name], round(min_sample_ms / max(last_ms, 1e-3)))
    samples: dict[str, list[float]] = {n: [] for n in methods}
    taken_in: dict[str, list[int]] = {n: [] for n in methods}
    start = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name, method in methods.items():
                if r % every.get(name, 1) == 0:
                    samples[name].append(_time_once(method, repeats[name]))
                    taken_in[name].append(r)
            if budget_s is not None and r >= 4 and time.perf_counter() - start > budget_s:
                break
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {n: Timing(n, s, taken_in[n]) for n, s in samples.items()}


def format_table(results: Mapping[str, Timing], baseline: str, title: str = "",
                 extra: Mapping[str, str] | None = None) -> str:
    """A plain-text table: method, median ms, IQR, n, ratio to ``baseline`` (paired by round,
    see :meth:`Timing.ratio_to`), and an extra column (e.g. memory) given as
    ``{"__header__": title, method: text}``."""
    base = results[baseline]
    header = f"{'method':<22} {'median ms':>10} {'IQR ms':>17} {'n':>4} {'x ' + baseline:>12}"
    if extra is not None:
        header += "  " + extra.get("__header__", "")
    lines = [title] if title else []
    lines += [header, "-" * len(header)]
    for name, t in results.items():
        q1, q3 = t.iqr
        line = (f"{name:<22} {t.median:>10.3f} {f'{q1:.3f}-{q3:.3f}':>17} {len(t.samples):>4} "
                f"{t.ratio_to(base):>12.2f}")
        if extra is not None and name in extra:
            line += "  " + extra[name]
        lines.append(line)
    return "\n".join(lines)


def print_table(results: Mapping[str, Timing], baseline: str, title: str = "",
                extra: Mapping[str, str] | None = None) -> None:
    print(format_table(results, baseline, title, extra), flush=True)


# ----------------------------------------------------------------------------- memory

@dataclass
class MemoryReport:
    """Resident memory of a child process, in MiB."""
    method: str
    setup_mib: float  # resident once the factory returned
    peak_mib: float   # peak resident while running the method

    @property
    def extra_mib(self) -> float:
        """Peak above the setup: what the method itself needed."""
        return max(0.0, self.peak_mib - self.setup_mib)


def status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), None where not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child_main(spec: str, method: str, kwargs: dict, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    module_name, function = spec.split(":")
    methods = getattr(importlib.import_module(module_name), function)(**kwargs)
    gc.collect()
    setup_kib = status_kib("VmRSS") or 0
    can_reset = reset_peak()
    for _ in range(steps):
        methods[method]()
    peak_kib = status_kib("VmHWM") if can_reset else None
    if peak_kib is None:  # ru_maxrss: peak of the whole process life, setup included
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"setup_kib": setup_kib, "peak_kib": peak_kib}


def peak_memory(spec: str, method: str, *, kwargs: Mapping | None = None, steps: int = 3,
                threads: int = 1, timeout_s: float = 600) -> MemoryReport:
    """Peak resident memory of ``method`` from the factory ``spec`` (``"module:function"``,
    called with ``kwargs``), run ``steps`` times in a fresh Python subprocess.

    The child runs from the current working directory with the current ``sys.path``, so
    ``benchmarks.run:make_methods`` works from the repository root.
    """
    payload = json.dumps([spec, method, dict(kwargs or {}), steps, threads])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", payload], capture_output=True, text=True,
        env=env, timeout=timeout_s, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"memory child for {spec} [{method}] failed:\n{completed.stderr}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return MemoryReport(method, result["setup_kib"] / 1024, result["peak_kib"] / 1024)


if __name__ == "__main__":
    print(json.dumps(_child_main(*json.loads(sys.argv[1]))))


def check_cost(default: Callable[[], None], results: dict) -> str:
    """The default check's cost from counts, which medians of separate model copies cannot
    resolve at 2%: checked steps of the default-policy model times what a checked step costs
    more (``grad1 checked`` - ``grad1 no check``), over its steps times ``grad1 no check``."""
    checks = psh.add_hooks(default.model).unseen.schedule.checks
    extra = results["grad1 checked"].median - results["grad1 no check"].median
    cost = checks * max(extra, 0.0) / (default.steps * results["grad1 no check"].median)
    return (f"default check: {checks} of {default.steps} steps checked, a checked step "
            f"{extra:+.2f} ms: {cost:.1%} of grad1's time")
