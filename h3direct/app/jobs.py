"""Jobs for `h3direct serve`: a bounded queue and one worker thread that runs one generation at a time.

At most `size` jobs wait behind the running one (size 0: a job is taken only when the worker is free); more are
refused (`Full`, with a Retry-After estimate from the last job's duration).

A job moves queued -> running -> done | failed | cancelled. Cancel (a client's DELETE, a waiting client that left,
the per-job timeout, server shutdown) is honoured between stages and between sampler steps: the pipeline's hooks
raise `Stop`, and the partly written output is removed. The worker never dies from a job: every failure is kept
on the job (its one-line error and HTTP status) and the next job runs.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error

FINAL = ("done", "failed", "cancelled")


class Stop(Exception):
    """Raised inside a running job's hooks: cancelled (409/503) or out of time (504)."""

    def __init__(self, reason: str, status: int):
        super().__init__(reason)
        self.status = status


@dataclass
class Job:
    id: str
    work: Any  # what the job runs (the service's: its request, options and uploads folder)
    output: Path
    created: float = field(default_factory=time.time)
    state: str = "queued"
    stage: str = "queued"
    step: int = 0
    steps: int = 0
    started: float | None = None
    finished: float | None = None
    timings: dict = field(default_factory=dict)
    summary: dict | None = None
    error: str | None = None
    status: int = 200  # the HTTP status a waiting client gets
    cancel_reason: str | None = None
    cancel_status: int = 409
    version: int = 0  # bumped on every change (server-sent events wait on it)
    done: threading.Event = field(default_factory=threading.Event)

    def view(self) -> dict:
        total_units = self.steps + 3  # text encode, steps, decode, write
        units = {"queued": 0, "conditioning": 0, "text_encode": 0, "sample": 1 + self.step,
                 "decode_video": 1 + self.steps, "decode_audio": 1 + self.steps, "write": 2 + self.steps,
                 "done": total_units}.get(self.stage, 0)
        progress = 1.0 if self.state == "done" else round(units / total_units, 4)
        return {"id": self.id, "state": self.state, "stage": self.stage, "step": self.step, "steps": self.steps,
                "progress": progress, "created": self.created, "started": self.started, "finished": self.finished,
                "timings": self.timings, "summary": self.summary, "error": self.error}


class JobQueue:
    """The job table, the waiting line (at most `size` queued jobs) and the worker thread."""

    def __init__(self, run_job, *, size: int, timeout_s: float, keep: int = 1000, on_finish=None):
        self._run_job = run_job  # (job, check) -> summary; check(stage=None, step=None) raises Stop
        self._on_finish = on_finish  # (job) -> None, once a job is over, whichever way
        self.size, self.timeout_s, self.keep = size, timeout_s, keep
        self.jobs: dict[str, Job] = {}
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self.running: Job | None = None
        self.stopping = False
        self.completed = 0
        self._last_seconds = 1.0
        self._ids = itertools.count(1)
        self._worker = threading.Thread(target=self._loop, name="h3direct-worker", daemon=True)

    def start(self) -> None:
        self._worker.start()

    # ---- clients ----
    def depth(self) -> int:
        with self._cv:
            return len(self._waiting)

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: the last job's duration times the jobs ahead."""
        return max(1, int(self._last_seconds * (len(self._waiting) + 1) + 0.999))

    def submit(self, work, output: Path, steps: int) -> Job:
        """Queue a job; raises Full when the line is full, Stopping when the server is shutting down."""
        with self._cv:
            if self.stopping:
                raise Stopping()
            busy = self.running is not None or bool(self._waiting)  # an idle worker takes a job even at size 0
            if busy and len(self._waiting) >= self.size:
                raise Full(self._retry_after())
            job = Job(f"{next(self._ids):06d}-{secrets.token_hex(4)}", work, output)
            job.steps = steps
            self.jobs[job.id] = job
            self._waiting.append(job)
            self._forget_old()
            self._cv.notify_all()
            return job

    def recent(self, n: int) -> list[Job]:
        with self._cv:
            return list(self.jobs.values())[::-1][:n]

    def get(self, job_id: str) -> Job | None:
        with self._cv:
            return self.jobs.get(job_id)

    def cancel(self, job: Job, reason: str, status: int = 409) -> None:
        """A queued job is dropped at once; a running one stops at its next stage or step."""
        with self._cv:
            if job.state in FINAL:
                return
            if job.state == "queued":
                self._waiting.remove(job)
                self._finish(job, "cancelled", error=f"cancelled: {reason}", status=status)
            else:
                job.cancel_reason, job.cancel_status = reason, status

    def stop(self) -> None:
        """Refuse new jobs, drop the queued ones, stop the running one at its next step."""
        with self._cv:
            self.stopping = True
            for job in list(self._waiting):
                self._waiting.remove(job)
                self._finish(job, "cancelled", error="cancelled: the server is shutting down", status=503)
            if self.running is not None:
                self.running.cancel_reason, self.running.cancel_status = "the server is shutting down", 503
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return self.running is None and not self._waiting

    def wait_changed(self, job: Job, version: int, timeout: float) -> None:
        with self._cv:
            if job.version == version:
                self._cv.wait(timeout)

    def join(self, timeout: float) -> bool:
        self._worker.join(timeout)
        return not self._worker.is_alive()

    # ---- the worker ----
    def _finish(self, job: Job, state: str, *, summary=None, error=None, status=200) -> None:
        job.state, job.summary, job.error, job.status = state, summary, error, status
        job.finished = time.time()
        if self._on_finish is not None:
            self._on_finish(job)
        job.work = None  # the request (maybe text-embedding tensors) is not needed any more
        if state == "done":
            job.stage = "done"
        job.version += 1
        job.done.set()
        self._cv.notify_all()

    def _forget_old(self) -> None:
        if len(self.jobs) <= self.keep:
            return
        for jid in [j.id for j in self.jobs.values() if j.state in FINAL][: len(self.jobs) - self.keep]:
            del self.jobs[jid]

    def _update(self, job: Job, **kw) -> None:
        with self._cv:
            for k, v in kw.items():
                setattr(job, k, v)
            job.version += 1
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self.stopping:
                    self._cv.wait()
                if self.stopping and not self._waiting:
                    return
                job = self._waiting.popleft()
                job.state, job.started = "running", time.time()
                self.running = job
                job.version += 1
                self._cv.notify_all()
            deadline = time.monotonic() + self.timeout_s

            def check(stage: str | None = None, step: int | None = None, job=job, deadline=deadline) -> None:
                if job.cancel_reason is not None:
                    raise Stop(job.cancel_reason, job.cancel_status)
                if time.monotonic() > deadline:
                    raise Stop(f"the job ran over the time limit of {self.timeout_s:g} s (--job-timeout)", 504)
                if stage is not None:
                    self._update(job, stage=stage)
                if step is not None:
                    self._update(job, step=step)

            t0 = time.perf_counter()
            try:
                summary = self._run_job(job, check)
            except Stop as e:
                timed_out = e.status == 504
                outcome = ("failed" if timed_out else "cancelled", None, str(e) if timed_out else f"cancelled: {e}",
                           e.status)
            except H3Error as e:  # the request turned out wrong only once running (e.g. an undecodable video)
                outcome = ("failed", None, one_line(str(e)), 400)
            except Exception as e:  # a bug or an out-of-memory: the job fails, the service goes on
                traceback.print_exc(file=sys.stderr)
                oom = type(e).__name__ == "OutOfMemoryError"
                outcome = ("failed", None, one_line(f"{'out of memory' if oom else 'internal error'}: "
                                                     f"{type(e).__name__}: {e}"), 507 if oom else 500)
            else:
                outcome = ("done", summary, None, 200)
            with self._cv:
                if outcome[0] == "done":
                    self._last_seconds = time.perf_counter() - t0
                    self.completed += 1
                self.running = None
                self._finish(job, outcome[0], summary=outcome[1], error=outcome[2], status=outcome[3])


class Full(Exception):
    def __init__(self, retry_after: int):
        super().__init__("the queue is full")
        self.retry_after = retry_after


class Stopping(Exception):
    pass


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
