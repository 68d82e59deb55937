"""`qwc tune`: MetaSchedule over the design space of qwc's own schedules.

A task is one (kind, N, K) of the model, deduplicated; decode GEMVs are measured at one token,
prefill GEMMs at PREFILL_TOKENS. Two families, by the activation bits the artifact will use:

- W4A32 (kernels/q4_f32.py, a compute definition plus a schedule): the design space is
  `apply_schedule` with each knob (rows per parallel task, tokens per prefill tile) drawn by
  `sample_categorical` from q4_f32.CHOICES.
- W4A8 prefill GEMMs (VNNI, sdot, smmla: hand-written TIR whose tiles are Python-level): the
  trace samples the tile size and annotates the kernel's root block with it (`A8_KNOB`); the
  builder (`_build`) rebuilds the kernel with the annotated tile. W4A8 decode GEMVs have no knob,
  nor the prefill GEMMs of a target with AMX (its tiles are 16 tokens by construction).

Every candidate list contains the hand schedule's values, so the search can only match or beat
it; MetaSchedule's ReplayTrace strategy samples the space (a few dozen points at most: an
evolutionary search has nothing to evolve).

The database folder holds MetaSchedule's own JSON database (every measured record, committed
as it is measured) and `qwc_tuning.json`: per task the hand schedule's time, the best tuned time
and knobs, and the trials done, rewritten atomically after every task. A rerun of the same
command skips finished tasks and gives an interrupted one only its remaining trials.
`qwc compile --tuning-db` uses a task's knobs only where they measured faster than the hand
schedule (`tuned_knobs`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from qwc import progress
from qwc.atomic import check_destination
from qwc.errors import QwcError
from qwc.passes.graph import has_zero_points, matmul_nbits_dims

from .kernels import w4a8_gemm
from .targets import GEMM_LAYOUT, GEMM_TILES, Target, default_act_bits, kernels_for, q4_0_path

SUMMARY = "qwc_tuning.json"
FORMAT = 1
PREFILL_TOKENS = 128   # the prefill tile tuned for: a typical prompt chunk


A8_KNOB = "qwc.tokens"                                 # root-block annotation: the tile size


@dataclass
class Task:
    kind: str          # "q4_f32_gemv" | "q4_f32_gemm" | "q4_a8_gemm"
    n: int
    k: int
    uses: int = 0      # matmuls of the model with this shape (the task's weight in the search)
    dot: str = ""     # q4_a8: "vnni" | "avx2" | "sdot" | "smmla"

    @property
    def key(self) -> str:
        return f"{self.kind}_{self.n}x{self.k}"

    @property
    def tokens(self) -> int:
        return 1 if self.kind.endswith("gemv") else PREFILL_TOKENS

    @property
    def nb(self) -> int:
        return (self.k + 31) // 32

    def workload(self, scheduled: bool = False):
        """The kernel at the measured token count as a module: unscheduled (what the search
        starts from) or with the hand schedule."""
        import tvm

        if self.kind == "q4_a8_gemm":
            f = _a8_standin(self.n, self.nb, self.tokens, self.dot).with_attr(
                "qwc.a8_task", f"{self.dot}:{self.n}:{self.nb}:{self.tokens}")
            return tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
        from .kernels import q4_f32
        make = q4_f32.kernel if scheduled else q4_f32.prim_func
        f = make(self.k, self.n, self.nb, self.kind.endswith("gemv"), m=self.tokens)
        return tvm.IRModule({"main": f.with_attr("global_symbol", "main")})

    def rate(self, seconds: float) -> str:
        """GB/s of weight bytes for a GEMV, GFLOP/s for a GEMM."""
        if self.kind.endswith("gemv"):
            return f"{self.n * self.nb * 18 / seconds / 1e9:.3g} GB/s"
        return f"{2 * self.tokens * self.n * self.k / seconds / 1e9:.3g} GFLOP/s"


@dataclass
class TaskRecord:
    hand_s: float | None = None
    best_s: float | None = None
    knobs: dict = field(default_factory=dict)
    trials: int = 0
    done: bool = False


def _a8_standin(n: int, nb: int, m: int, dot: str):
    """What MetaSchedule sees of a W4A8 task: the kernel's signature at m tokens (its runner
    makes the inputs from it) and a named root block for the trace to annotate. The body is a
    placeholder: `_build` builds the real kernel, and MetaSchedule's flop estimator cannot read
    the hand kernel's vector intrinsics."""
    from tvm.script import tirx as T

    from .kernels.row_groups import ROWS, groups

    ng = groups(n)
    layout = GEMM_LAYOUT[dot]                           # act_quant.fused_quantizer's
    scales = (m, nb, 2) if layout == "arm_pairs" else (m, nb)

    @T.prim_func(private=True, check_well_formed=False)
    def standin(aq: T.Buffer((m, nb, 32), "int8"), ad: T.Buffer(scales, "float32"),
                off: T.Buffer(scales, "int32"), w: T.Buffer((ng, nb, 4, 4 * ROWS), "uint8"),
                ws: T.Buffer((ng, nb, ROWS), "float16"), y: T.Buffer((m, n), "float32")):
        with T.sblock("root"):
            y[0, 0] = T.float32(0)

    return standin


def extract_tasks(model: onnx.ModelProto, act_bits: int = 32, features=frozenset()) -> list[Task]:
    """The model's tunable kernels for an artifact with `act_bits` activations on a target with
    `features`, deduplicated by kind and shape."""

    tasks: dict[str, Task] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        k, n, block, bits = matmul_nbits_dims(node)
        path = q4_0_path(block, bits, act_bits, features, has_zero_points(node))
        if path == "f32":
            new = [Task(kind, n, k) for kind in ("q4_f32_gemv", "q4_f32_gemm")]
        elif path is not None and kernels_for(features).int_dots.amx:
            continue  # AMX's tiles are 16 tokens by construction (kernels/x86/amx.py): no knob
        elif path is not None:   # a W4A8 integer-dot kernel
            new = [Task("q4_a8_gemm", n, k, dot=kernels_for(features).int_dots.prefill)]
        else:
            continue  # the generic kernels, which have no knobs
        for t in new:
            tasks.setdefault(t.key, t).uses += 1
    return list(tasks.values())


def _space(task: Task):
    if task.kind == "q4_a8_gemm":
        choices = list(GEMM_TILES[task.dot])

        def a8(sch):
            t = sch.sample_categorical(candidates=choices, probs=[1 / len(choices)] * len(choices))
            sch.annotate(sch.get_sblock("root"), A8_KNOB, t)

        return a8

    from .kernels import q4_f32

    rows = [r for r in q4_f32.CHOICES["rows"] if task.n % r == 0]
    tokens = list(q4_f32.CHOICES["tokens"])

    def fn(sch):
        r = sch.sample_categorical(candidates=rows, probs=[1 / len(rows)] * len(rows))
        t = (sch.sample_categorical(candidates=tokens, probs=[1 / len(tokens)] * len(tokens))
             if task.tokens > 1 else 1)
        q4_f32.apply_schedule(sch, task.n, task.tokens == 1, r, t)

    return fn


def _knobs(trace, task: Task) -> dict:
    """The knob values a record's trace sampled, in the order _space samples them."""
    values = []
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            cands = [int(c) for c in inst.attrs[0]]
            values.append(cands[int(trace.decisions[inst])])
    if task.kind == "q4_a8_gemm":
        return {"tokens": values[0]} if values else {}
    out = {"rows": values[0]} if values else {}
    if len(values) > 1:
        out["tokens"] = values[1]
    return out


class Session:
    def __init__(self, db: Path, target: Target, rpc: tuple[str, int, str] | None = None):
        self.db = Path(db)
        self.target = target
        self.rpc = rpc
        self.summary_path = self.db / SUMMARY
        self._pools = None
        if self.db.is_dir() and not self.summary_path.is_file() and any(self.db.iterdir()):
            # tune writes its records into the folder: never into one that holds a user's files
            raise QwcError(f"cannot use {self.db} as a tuning database: it holds files and no {SUMMARY} "
                           "(choose a new or empty folder)")
        check_destination(self.db, folder=True)   # created by the first save, not before the work
        self.records: dict[str, TaskRecord] = {}
        if self.summary_path.is_file():
            try:
                raw = json.loads(self.summary_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise QwcError(f"{self.summary_path}: corrupt ({e})") from None
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise QwcError(f"{self.summary_path}: unknown format {raw.get('format')}")
            if raw.get("target") != target.name:
                raise QwcError(f"{self.db} holds tuning for target {raw.get('target')}, not {target.name}")
            try:
                self.records = {k: TaskRecord(**v) for k, v in raw["tasks"].items()}
            except (KeyError, TypeError, AttributeError):
                raise QwcError(f"{self.summary_path}: corrupt (its tasks are not tuning records)") from None

    def _mkdir(self) -> None:
        try:
            self.db.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QwcError(f"cannot use {self.db} as a tuning database: {e.strerror}") from None

    def save(self) -> None:
        self._mkdir()
        tmp = self.summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "target": self.target.name,
                                   "tasks": {k: asdict(v) for k, v in self.records.items()}}, indent=1))
        os.replace(tmp, self.summary_path)

    # -- measurement -----------------------------------------------------------------------
    def pools(self):
        """(builder, runner), made once: each starts worker processes."""
        if self._pools is None:
            self._pools = (self._builder(), self._runner())
        return self._pools

    def _builder(self):
        from tvm.s_tir import meta_schedule as ms

        if self.target.cross_compiler:
            return ms.builder.LocalBuilder(timeout_sec=300, f_build=_build,
                                           f_export=_cross_export(self.target.cross_compiler))
        return ms.builder.LocalBuilder(timeout_sec=300, f_build=_build)

    def _runner(self):
        from tvm.s_tir import meta_schedule as ms

        cfg = ms.runner.EvaluatorConfig(number=5, repeat=3, min_repeat_ms=50, enable_cpu_cache_flush=False)
        if self.rpc is None:
            return ms.runner.LocalRunner(evaluator_config=cfg, timeout_sec=120)
        host, port, key = self.rpc
        rpc = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=600)
        return ms.runner.RPCRunner(rpc_config=rpc, evaluator_config=cfg, max_workers=1)

    def measure_hand(self, task: Task) -> float:
        from tvm.s_tir import meta_schedule as ms

        mod = task.workload(scheduled=True)
        builder, runner = self.pools()
        built = builder.build([ms.builder.BuilderInput(mod, self.target.tvm_target())])[0]
        if built.error_msg:
            raise QwcError(f"{task.key}: building the hand schedule failed: {built.error_msg.splitlines()[-1]}")
        arg_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        fut = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", arg_info)])[0]
        res = fut.result()
        if res.error_msg:
            raise QwcError(f"{task.key}: running the hand schedule failed: {res.error_msg.strip().splitlines()[-1]}")
        secs = [float(x) for x in res.run_secs]
        return sum(secs) / len(secs)

    def tune(self, task: Task, trials: int) -> TaskRecord:
        from tvm.s_tir import meta_schedule as ms

        rec = self.records.setdefault(task.key, TaskRecord())
        self._mkdir()
        database = ms.database.JSONDatabase(path_workload=str(self.db / "database_workload.json"),
                                            path_tuning_record=str(self.db / "database_tuning_record.json"),
                                            module_equality="structural")
        mod = task.workload()
        done = 0
        if database.has_workload(mod):
            done = len(database.get_top_k(database.commit_workload(mod), 1 << 30))
        remaining = trials - done
        if remaining > 0:
            ctx = ms.TuneContext(mod=mod, target=self.target.tvm_target(),
                                 space_generator=ms.space_generator.ScheduleFn(
                                     _space(task), sch_rules=[], postprocs=[], mutator_probs={}),
                                 search_strategy=ms.search_strategy.ReplayTrace(),
                                 task_name=task.key, num_threads=os.cpu_count() or 1)
            builder, runner = self.pools()
            ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=str(self.db), max_trials_global=remaining,
                          num_trials_per_iter=min(8, remaining), builder=builder, runner=runner,
                          database=database, cost_model="random", measure_callbacks="default",
                          task_scheduler="round-robin")
        top = database.get_top_k(database.commit_workload(mod), 1 << 30)
        rec.trials = len(top)
        if top:
            best = top[0]
            secs = [float(x) for x in best.run_secs]
            rec.best_s = sum(secs) / len(secs)
            rec.knobs = _knobs(best.trace, task)
        rec.done = rec.trials >= trials
        return rec


def _build(mod, target, _params):
    """LocalBuilder's build without its default's `import tvm.s_tir.tensor_intrin`, which takes
    ~25 s in every (single-use) builder process; qwc's tunable kernels use no tensor intrinsic.
    A W4A8 candidate is rebuilt with the tile its trace annotated on the root block."""
    import tvm
    from tvm.driver import build

    f = mod["main"]
    if f.attrs is not None and "qwc.a8_task" in f.attrs:
        dot, n, nb, m = str(f.attrs["qwc.a8_task"]).split(":")
        ann = f.body.block.annotations
        tokens = int(ann[A8_KNOB]) if A8_KNOB in ann else None
        f = w4a8_gemm(dot, int(n), int(nb), "float16", tokens=tokens, m=int(m))   # fp16 scales, as qwc's Q4_0
        mod = tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
    return build(mod, target=target)


def _cross_export(compiler: str):
    """LocalBuilder's export for a cross target: link with the target's cross compiler."""

    def export(mod) -> str:
        import tempfile

        from tvm.support import cc

        path = os.path.join(tempfile.mkdtemp(), "tuned.so")
        mod.export_library(path, fcompile=cc.cross_compiler(compiler))
        return path

    return export


def run(src, target: Target, trials: int, db: Path, rpc: tuple[str, int, str] | None = None,
        time_budget_min: float | None = None, act_bits: int | None = None) -> list[tuple[Task, TaskRecord]]:
    """Tune the kernels an artifact with `act_bits` activations (None: the target's default,
    as `qwc compile` picks it) would use."""
    from qwc.config import load_for_graph
    from qwc.passes.pipeline import load_canonical

    if trials < 1:
        raise QwcError("--trials must be at least 1")
    act_bits = default_act_bits(target.features) if act_bits is None else act_bits
    session = Session(db, target, rpc)   # checks the folder before the passes run
    model = load_canonical(src, load_for_graph(src))
    tasks = extract_tasks(model, act_bits, target.features)
    if not tasks and act_bits == 8 and kernels_for(target.features).int_dots.amx:
        raise QwcError(f"{src}: no tunable kernels for --act-bits 8 on {target.name}: its prefill GEMMs take "
                       "AMX's fixed 16-token tiles (--target x86-avx512 tunes VNNI's, for an x86-avx512 artifact)")
    if not tasks:
        raise QwcError(f"{src}: no tunable kernels for --act-bits {act_bits} on {target.name} "
                       "(no 4-bit, block-32 MatMulNBits)")
    deadline = None if time_budget_min is None else time.monotonic() + 60 * time_budget_min
    finished = sum(1 for t in tasks if session.records.get(t.key, TaskRecord()).done)
    if finished:
        progress.info(f"[qwc] resuming {db}: {finished}/{len(tasks)} tasks already tuned")
    out = []
    for i, task in enumerate(tasks, 1):
        rec = session.records.setdefault(task.key, TaskRecord())
        if rec.done and rec.trials >= trials:
            out.append((task, rec))
            continue
        if deadline is not None and time.monotonic() > deadline:
            progress.info(f"[qwc] time budget spent; {len(tasks) - i + 1} tasks left for a rerun")
            break
        progress.info(f"[qwc] task {i}/{len(tasks)} {task.key} (used {task.uses}x): {trials} trials")
        if rec.hand_s is None:
            rec.hand_s = session.measure_hand(task)
            session.save()
        rec = session.tune(task, trials)
        session.save()
        best = f"{task.rate(rec.best_s)} {rec.knobs}" if rec.best_s else "no valid record"
        progress.info(f"[qwc]   hand {task.rate(rec.hand_s)}, best tuned {best}"
                      + (" (faster: used)" if rec.best_s and rec.best_s < rec.hand_s else " (hand kept)"))
        out.append((task, rec))
    return out


def tuned_knobs(db: Path, target: Target) -> dict[str, dict]:
    """task key -> knobs, for the tasks whose tuned schedule beat the hand one (the keys say
    which kernel family: q4_f32_* for --act-bits 32, q4_a8_* for 8)."""
    db = Path(db)
    if not (db / SUMMARY).is_file():
        raise QwcError(f"{db}: not a tuning database (no {SUMMARY}); run `qwc tune` first")
    session = Session(db, target)
    return {k: r.knobs for k, r in session.records.items()
            if r.best_s is not None and r.hand_s is not None and r.best_s < r.hand_s and r.knobs}
