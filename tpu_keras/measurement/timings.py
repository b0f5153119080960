"""Where a run's wall time goes, from process start to export.

Every run ends with one log line and `DIR/timings.json` that split its
wall time into phases: start-up and imports, data, cluster, model build,
checkpoint restore, the first compile of each step function, training
steps, validation, checkpoint saves, the time `fit` takes to return after
its last step (input iterator teardown), export, and what is left (`other`:
callbacks, logging). `outside_steps_fraction` is the share of the wall time
not spent in training steps: what the toolkit costs around the work.

The training steps are the executions of `fit`, timed by
`callbacks.FitTimer`. The first execution of each `fit` takes longer than
the others: it compiles the train step (or loads it), waits for the
input pipeline's first batch, and runs the step's first executions, which
are slower while memory and thread pools warm up. On jax, `compile` is the
time measured in tracing, lowering and compiling (`compile_cache.CompileCounter`),
and the rest of that call's excess over the median execution is `warmup`;
on tf, which does not report its compiles, the whole excess is `compile`.
Only the process's own exit is missing here; `scripts/benchmark.py --run`
times it from outside.

GRPO's runs (`objectives.grpo_steps`) add `sampling`, the policy completing
prompts (its first call compiles the sampler; evaluation's sampling counts
here too), and `rewards`, the reward functions scoring the completions.

Beside the seconds, `peak_host_bytes` is the process's peak resident memory
so far (the kernel's high-water mark for this program): host memory is what
limits loading a large model on a TPU VM, and a figure like the speed.
`peak_host_bytes_before` gives the same mark as each phase first began:
the peak less its value before `model` is what the model cost the host,
apart from the libraries and the data pipeline.

`checkpoints` is the time the loop blocked on saves: copying the state to
host memory and, with asynchronous saves, waiting for a write still in
flight (at the next save, or at the end of the run). The writes themselves
overlap training and are reported beside the phases, under `background`.
"""

import collections
import contextlib
import json
import os
import resource
import statistics
import time

from absl import logging

from tpu_keras import workdir


# Phases in the order a run meets them; the log line keeps it.
PHASES = ("startup", "data", "cluster", "model", "restore", "compile", "warmup", "steps", "sampling",
          "rewards", "validation", "checkpoints", "fit_teardown", "export", "other")


def process_start() -> float:
    """When this process started (time.time() scale), from /proc; else when this module loaded."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _MODULE_LOADED


_MODULE_LOADED = time.time()


class RunTimings:
    """Accumulates seconds per phase; `callbacks.FitTimer` adds what happens inside `fit`."""

    def __init__(self, started: float):
        self._started = started
        self.seconds = collections.defaultdict(float)
        self.seconds["startup"] = time.time() - self._started  # until the run's code begins
        self.host_calls, self.first_host_calls = [], []  # seconds; the first of each fit apart
        # What the persistent compilation cache did for the compile: `compile_cache.CompileCounter.report()`.
        self.compile_cache = {}
        # Seconds of work that overlapped the phases: {"checkpoint_writes": s, "checkpoint_waits": s}.
        self.background = {}
        self.always_shown = {"compile"}  # in the time line even when under 0.05 s
        self.peak_before = {}  # {phase: the peak resident memory as it first began}

    @contextlib.contextmanager
    def phase(self, name: str):
        self.peak_before.setdefault(name, peak_host_bytes())
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def timed(self, name: str, fn):
        """`fn`, with the time of each call counted under `name`."""
        def call(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return call

    def report(self) -> dict:
        """Seconds per phase, the wall time so far and the share outside training steps."""
        wall = time.time() - self._started
        calls, firsts = self.host_calls, self.first_host_calls
        typical = statistics.median(calls) if calls else min(firsts, default=0.0)
        excess = sum(max(0.0, first - typical) for first in firsts)
        measured = self.compile_cache.get("compile_seconds")
        self.seconds["compile"] = excess if measured is None else measured
        self.seconds["warmup"] = max(0.0, excess - self.seconds["compile"])
        self.seconds["steps"] = (sum(calls) + sum(firsts) - self.seconds["compile"]
                                 - self.seconds["warmup"])
        seconds = {name: self.seconds.get(name, 0.0) for name in PHASES}
        seconds["other"] = max(0.0, wall - sum(seconds.values()))
        return {"wall_seconds": round(wall, 3),
                "seconds": {name: round(value, 3) for name, value in seconds.items()},
                "outside_steps_fraction": round(1 - seconds["steps"] / wall, 4) if wall else 0.0,
                "peak_host_bytes": peak_host_bytes(), "peak_host_bytes_before": dict(self.peak_before),
                "background": {name: round(value, 3) for name, value in self.background.items()},
                "compile_cache": {**self.compile_cache, "note": describe_cache(self.compile_cache)}}

    def finish(self, path: str | None) -> dict:
        """Logs the breakdown in one line and writes it to `path` (when given); returns it."""
        report = self.report()
        logging.info("time: %.1f s in all, %.0f%% outside training steps | %s | peak host memory %.2f GiB",
                     report["wall_seconds"], 100 * report["outside_steps_fraction"],
                     " | ".join(f"{name} {value:.1f}" + _note(name, report)
                                for name, value in report["seconds"].items()
                                if value >= 0.05 or name in self.always_shown or _note(name, report)),
                     report["peak_host_bytes"] / 2**30)
        if path:
            workdir.write_whole(path, json.dumps(report, indent=2))
        return report


def peak_host_bytes() -> int:
    """This process's peak resident memory so far, in bytes: Linux's `VmHWM`, which starts
    anew with the program. `ru_maxrss` (elsewhere) is kept across `execve`, so a run started
    by a larger process would report that process's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _note(phase: str, report: dict) -> str:
    """What the time line adds after a phase's seconds: the compile cache's part, and the
    checkpoint writes that went on in the background."""
    if phase == "compile":
        return f" {report['compile_cache']['note']}"
    writes = report["background"].get("checkpoint_writes")
    if phase == "checkpoints" and writes is not None:
        return (f" (+{writes:.1f} written in the background, "
                f"{report['background'].get('checkpoint_waits', 0.0):.1f} of the blocked time waiting for a write)")
    return ""


def describe_cache(report: dict) -> str:
    """The compile figure's note in the time line: whether the persistent compilation
    cache served the compile ('(from the cache)') or XLA compiled it."""
    if not report or not report.get("dir"):
        return "(no cache)"
    programs, hits = report["programs"], report["from_cache"]
    if not programs:
        return "(nothing compiled)"
    if hits == programs:
        return "(from the cache, steps not traced)" if report.get("steps_loaded") else "(from the cache)"
    if hits:
        return f"({hits} of {programs} programs from the cache)"
    return "(compiled: not in the cache)"
