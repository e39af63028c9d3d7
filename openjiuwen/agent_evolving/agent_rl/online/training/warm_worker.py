"""The warm multi-tenant trainer process: `python -m ...training.warm_worker [--max-group N] [--gather-s S]`.

One long-lived child of the RL Service (backends/warm_local.py) that keeps the base model and its tokenizer loaded
between Training Runs. The service writes each run's batch and spec exactly as for the per-run worker
(local_worker.py) and sends one JSON line on stdin per request:

    {"op": "train", "run": RUN_ID, "spec": SPEC_PATH}    queue a run
    {"op": "cancel", "run": RUN_ID}                        drop it: at once if queued, else before its next PPO step

and reads one JSON line per event on stdout, each naming its run: `step` (metrics), `done` (as local_worker's),
`failed` (error), `canceled`. Runs queued together (up to `--max-group`, on the same base model) are trained
together (warm_group.py): each loads only its lineage's adapter (the parent version's, or a new LoRA seeded as the
per-run worker seeds it) next to the others on the one base model, gets a fresh AdamW (no optimizer state is kept
between runs, by either worker), trains, writes only its adapter into its `output_dir`, and is removed from the
model. Publishing stays in the service. stdin at EOF (the service is gone) ends the process; so does the parent-death
watchdog.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

IDLE_ADAPTER = "warm_idle"  # a placeholder that keeps the model a PeftModel between runs; never trained or routed to


class Events:
    """The event stream to the service; the reader thread writes to it too (a canceled queued run)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


class Inbox:
    """Requests from stdin: the queue of runs to train and the set of runs canceled while training."""

    def __init__(self, events: Events) -> None:
        self._events = events
        self._cond = threading.Condition()
        self._queue: list[dict[str, Any]] = []
        self._canceled: set[str] = set()

    def read_forever(self, stream: TextIO) -> None:
        for line in stream:
            try:
                request = json.loads(line)
            except json.JSONDecodeError:
                continue
            if request.get("op") == "train":
                with self._cond:
                    self._queue.append({**request, "queued_at": time.monotonic()})
                    self._cond.notify()
            elif request.get("op") == "cancel":
                self._cancel(str(request.get("run")))
        os._exit(0)  # stdin closed: the service is gone, and nothing here outlives it

    def _cancel(self, run_id: str) -> None:
        with self._cond:
            queued = [r for r in self._queue if r["run"] == run_id]
            self._queue = [r for r in self._queue if r["run"] != run_id]
            if not queued:
                self._canceled.add(run_id)
        if queued:
            self._events.emit({"event": "canceled", "run": run_id})

    def is_canceled(self, run_id: str) -> bool:
        with self._cond:
            return run_id in self._canceled

    def forget(self, run_id: str) -> None:
        with self._cond:
            self._canceled.discard(run_id)

    def take_group(self, max_group: int, gather_s: float) -> list[dict[str, Any]]:
        """Wait for a run; give runs queued within `gather_s` of it a chance to join; return up to `max_group`."""
        with self._cond:
            while not self._queue:
                self._cond.wait()
            full = len(self._queue) >= max_group
        if not full:  # one run at a time (max_group 1) or a full group: nothing to wait for
            time.sleep(gather_s)  # concurrent runs are claimed together but their requests arrive one by one
        with self._cond:
            group, self._queue = self._queue[:max_group], self._queue[max_group:]
            return group


class WarmTrainer:
    """The base model, loaded once, and the runs trained on it."""

    def __init__(self, events: Events, inbox: Inbox, max_group: int) -> None:
        self._events = events
        self._inbox = inbox
        self._max_group = max_group
        self._base_key: tuple[str, str] | None = None
        self._model: Any = None  # PeftModel over the base model
        self._tokenizer: Any = None
        self._layers: list[Any] = []
        self.base_loads = 0

    def _ensure_base(self, spec: dict[str, Any], settings: Any) -> float:
        """Load the base model unless it is the one held; the seconds spent (0.0 when warm)."""
        key = (spec["base_model_path"], settings.dtype)
        if key == self._base_key:
            return 0.0
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .adapter_routing import tuner_layers

        started = time.perf_counter()
        self._model = self._tokenizer = None
        gc.collect()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            settings.dtype, torch.float32)
        self._tokenizer = AutoTokenizer.from_pretrained(key[0])
        base = AutoModelForCausalLM.from_pretrained(key[0], dtype=dtype)
        placeholder = LoraConfig(r=1, lora_alpha=1, target_modules=settings.target_modules, lora_dropout=0.0,
                                 bias="none", task_type="CAUSAL_LM")
        self._model = get_peft_model(base, placeholder, adapter_name=IDLE_ADAPTER)
        self._layers = tuner_layers(self._model)
        self._base_key = key
        self.base_loads += 1
        return time.perf_counter() - started

    def _add_adapter(self, name: str, spec: dict[str, Any], settings: Any) -> None:
        import torch
        from peft import LoraConfig

        from .adapter_routing import tuner_layers

        if spec.get("init_lora_path"):
            self._model.load_adapter(spec["init_lora_path"], adapter_name=name, is_trainable=True)
        else:
            torch.manual_seed(settings.seed)  # a new adapter's initial weights, as the per-run worker draws them
            lora = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha,
                              target_modules=settings.target_modules, lora_dropout=0.0, bias="none",
                              task_type="CAUSAL_LM")
            self._model.add_adapter(name, lora)
        self._layers = tuner_layers(self._model)  # a new target module adds a layer

    def _save_adapter(self, name: str, out_dir: Path) -> None:
        """Only `name`'s adapter, in PEFT format at the root of `out_dir` (peft writes a non-default adapter into a
        subfolder named after it)."""
        from .adapter_files import ADAPTER_FILES

        self._model.save_pretrained(str(out_dir), selected_adapters=[name])
        sub = out_dir / name
        for file in ADAPTER_FILES:
            os.replace(sub / file, out_dir / file)
        shutil.rmtree(sub, ignore_errors=True)
        (out_dir / "README.md").unlink(missing_ok=True)

    def _drop_adapter(self, name: str) -> None:
        try:
            self._model.delete_adapter(name)
        except Exception:  # noqa: BLE001 - never half-added: a failed load leaves no adapter to remove
            pass

    def serve(self, max_group: int, gather_s: float) -> None:
        while True:
            group = self._inbox.take_group(max_group, gather_s)
            self.train_group(group)

    def train_group(self, requests: list[dict[str, Any]]) -> None:
        from .adapter_routing import AdapterView, set_trainable
        from ...common.policy_names import BASE_POLICY
        from .local_worker import _load_batch, _seed_torch
        from .ppo_settings import PPOSettings
        from .ppo_update import PPOUpdate
        from .warm_group import LineageRun, train_together

        group_started = time.monotonic()
        runs: list[LineageRun] = []
        info: dict[str, dict[str, Any]] = {}
        for request in requests:
            run_id = request["run"]
            adapter = "run_" + "".join(c if c.isalnum() else "_" for c in run_id)
            try:
                spec = json.loads(Path(request["spec"]).read_bytes())
                settings = PPOSettings.from_dict(spec["settings"])
                _seed_torch(settings)
                base_s = self._ensure_base(spec, settings)
                t = time.perf_counter()
                batch = _load_batch(spec, settings, self._tokenizer)
                self._add_adapter(adapter, spec, settings)
                adapter_s = time.perf_counter() - t
                t = time.perf_counter()
                set_trainable(self._model, [adapter])
                update = PPOUpdate(AdapterView(self._model, adapter, self._layers), batch, settings)
                update.fix_log_probs(spec.get("parent_version") or BASE_POLICY)  # reference, π_old, the report
                runs.append(LineageRun(run_id, update, update.slices()))
                info[run_id] = {"adapter": adapter, "spec": spec, "batch": batch, "timings": {
                    "queued_s": group_started - request.get("queued_at", group_started),
                    "base_load_s": base_s, "adapter_load_s": adapter_s, "prepare_s": time.perf_counter() - t,
                }}
            except Exception as exc:  # noqa: BLE001 - this run fails; the others of the group go on
                self._drop_adapter(adapter)
                self._events.emit({"event": "failed", "run": run_id, "error": _describe(exc)})
        if not runs:
            return
        set_trainable(self._model, [info[r.run_id]["adapter"] for r in runs])
        adapters = [info[r.run_id]["adapter"] for r in runs]
        t = time.perf_counter()
        try:
            dropped = train_together(
                runs, emit_step=lambda run, m: self._events.emit({"event": "step", "run": run.run_id, "metrics": m}),
                canceled=self._inbox.is_canceled,
                # peft's adapter switches (disable_adapter's exit) may have frozen another adapter of the group
                before_backward=lambda: set_trainable(self._model, adapters),
            )
        except Exception as exc:  # noqa: BLE001 - a shared backward failed: every run of the group fails
            for run in runs:
                self._events.emit({"event": "failed", "run": run.run_id, "error": _describe(exc)})
                self._finish(run.run_id, info)
            return
        train_s = time.perf_counter() - t
        for run in runs:
            run_info = info[run.run_id]
            if run.run_id in dropped:
                self._events.emit({"event": "canceled", "run": run.run_id})
                self._finish(run.run_id, info)
                continue
            try:
                t = time.perf_counter()
                self._save_adapter(run_info["adapter"], Path(run_info["spec"]["output_dir"]))
                timings = {**run_info["timings"], "train_s": train_s, "save_s": time.perf_counter() - t,
                           "group": len(runs)}
                # The run record's split as the per-run worker's (metrics.timings; the backend adds publish): the
                # model load is the base (shared, 0 when warm) and the adapter, the group's steps are shared.
                split = {"load": round(run_info["timings"]["base_load_s"] + run_info["timings"]["adapter_load_s"], 3),
                         "pi_old": round(run_info["timings"]["prepare_s"], 3), "steps": round(train_s, 3),
                         "save": round(timings["save_s"], 3)}
                self._events.emit({
                    "event": "done", "run": run.run_id,
                    "metrics": {**run.update.run_record(run.step_metrics), "timings": split},
                    "dropped_sample_ids": run_info["batch"].dropped_sample_ids, "timings": timings,
                })
            except Exception as exc:  # noqa: BLE001
                self._events.emit({"event": "failed", "run": run.run_id, "error": _describe(exc)})
            self._finish(run.run_id, info)

    def _finish(self, run_id: str, info: dict[str, dict[str, Any]]) -> None:
        self._drop_adapter(info[run_id]["adapter"])
        self._inbox.forget(run_id)
        gc.collect()


def _describe(exc: BaseException) -> str:
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"[:1500]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openjiuwen.agent_evolving.agent_rl.online.training.warm_worker",
                                     description="The warm multi-tenant local trainer (started by the RL Service).")
    parser.add_argument("--max-group", type=int, default=8, help="runs trained together in one step, at most")
    parser.add_argument("--gather-s", type=float, default=0.2,
                        help="seconds to wait after a run arrives for others to join its group")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_group < 1 or args.gather_s < 0:
        parser.error("--max-group must be >= 1 and --gather-s >= 0")
    os.umask(0o077)  # what the trainer writes is private until the repository seals the version
    from .local_worker import _events_stream

    events = Events(_events_stream())
    from ..watchdog import install_parent_death_watchdog

    install_parent_death_watchdog()  # the trainer never outlives the service that started it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    inbox = Inbox(events)
    threading.Thread(target=inbox.read_forever, args=(sys.stdin,), daemon=True, name="warm-inbox").start()
    WarmTrainer(events, inbox, args.max_group).serve(args.max_group, args.gather_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
