"""``meshtron tune``: plan the layout of a run on a cluster, and check the plan by trial runs.

The model, batch and precision come from the config (``--config`` and overrides) exactly as
``meshtron train`` reads them; ``--cluster.gpu``/``--cluster.gpus``/``--cluster.gpus_per_node``
say where it runs. Any ``parallel.*`` field (and ``train.micro_batch``, ``train.recompute``)
given on the command line or in the config file pins that field of the search. The winner is
written as a config that ``meshtron train --config`` runs as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import yaml

from meshtron.config import Config, load_config, parse_override
from meshtron.costmodel.against_published import plan_confidence
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.problem import Cluster, Problem, problem_of
from meshtron.costmodel.profiles import builtin_profiles, load_profile
from meshtron.costmodel.search import Pins, SearchResult, apply, search
from meshtron.errors import MeshtronError
from meshtron.files import check_output_file

CLUSTER_FIELDS = ("gpu", "gpus", "gpus_per_node")
PIN_FIELDS = {**{f"parallel.{k}": k for k in ("tp", "cp", "pp", "vpp", "schedule", "ep",
                                              "etp", "zero", "sp")},
              "train.micro_batch": "micro_batch", "train.recompute": "recompute"}


def split_cluster(extra: list[str]) -> tuple[dict[str, object], list[str]]:
    """``--cluster.*`` arguments apart from the config overrides."""
    cluster, rest = {}, []
    for arg in extra:
        if arg.lstrip("-").startswith("cluster."):
            section, key, value = parse_override(arg)
            if key not in CLUSTER_FIELDS:
                raise MeshtronError(f"unknown option --cluster.{key}; use "
                                    + ", ".join(f"--cluster.{k}" for k in CLUSTER_FIELDS))
            cluster[key] = value
        else:
            rest.append(arg)
    return cluster, rest


def cluster_of(given: dict[str, object]) -> Cluster:
    if "gpu" not in given or "gpus" not in given:
        raise MeshtronError("tune needs --cluster.gpu=NAME|PROFILE.json and --cluster.gpus=N "
                            f"(built-in GPUs: {', '.join(builtin_profiles())})")
    profile = load_profile(str(given["gpu"]))
    gpus = given["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise MeshtronError(f"--cluster.gpus must be a positive whole number, got {gpus!r}")
    per_node = given.get("gpus_per_node", profile.gpus_per_node)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise MeshtronError(f"--cluster.gpus_per_node must be a positive whole number, got "
                            f"{per_node!r}")
    return Cluster(dataclasses.replace(profile, gpus_per_node=per_node), gpus)


def given_fields(config_path: str | None, overrides: list[str]) -> dict[str, object]:
    """The ``section.field`` values the config file or the command line set."""
    given: dict[str, object] = {}
    if config_path:
        raw = yaml.safe_load(Path(config_path).read_text()) or {}
        for section, values in raw.items():
            for key, value in (values if isinstance(values, dict) else {}).items():
                given[f"{section}.{key}"] = value
    for text in overrides:
        section, key, value = parse_override(text)
        given[f"{section}.{key}"] = value
    return given


def layout_pins_of(given: dict[str, object]) -> Pins:
    """The layout fields the user fixed."""
    return Pins(**{field: given[name] for name, field in PIN_FIELDS.items()
                   if given.get(name) is not None})


def planning_defaults(cfg: Config, given: dict[str, object], cluster: Cluster
                      ) -> tuple[Config, list[str]]:
    """A plan of thousands of GPUs needs a batch of their size: unset, ``train.seq_len`` is
    the model's positions up to 4096, ``train.global_batch`` a quarter of the GPUs (a power of
    two, at least the config's), and on GPUs ``precision.dtype`` is bf16 (training defaults
    suit a CPU)."""
    train, precision, said = cfg.train, cfg.precision, []
    if "train.seq_len" not in given:
        train = dataclasses.replace(train, seq_len=min(cfg.model.max_seq_len, 4096))
        said.append(f"train.seq_len={train.seq_len}")
    if "train.global_batch" not in given:
        batch = max(train.global_batch, 2 ** math.ceil(math.log2(max(1, cluster.gpus / 4))))
        train = dataclasses.replace(train, global_batch=batch)
        said.append(f"train.global_batch={batch}")
    if "precision.dtype" not in given and cluster.profile.compute_units is None:
        precision = dataclasses.replace(precision, dtype="bf16")
        said.append("precision.dtype=bf16")
    return dataclasses.replace(cfg, train=train, precision=precision), said


def check_pins(cfg: Config, pins: Pins, cluster: Cluster) -> None:
    """Pins that contradict each other or the world size, said before searching."""
    from meshtron.parallel.mesh.layout import MeshLayout

    fixed = [pins.tp or 1, pins.cp or 1, pins.pp or 1]
    if cluster.gpus % (fixed[0] * fixed[1] * fixed[2]):
        MeshLayout.of(dataclasses.replace(cfg.parallel, tp=fixed[0], cp=fixed[1], pp=fixed[2]),
                      cluster.gpus)  # its own message
    if pins.vpp and pins.vpp > 1 and pins.schedule not in (None, "interleaved", "zb-v"):
        raise MeshtronError(f"parallel.vpp={pins.vpp} needs parallel.schedule=interleaved or "
                            f"zb-v, not {pins.schedule}")
    if pins.schedule == "zb-v" and pins.vpp not in (None, 2):
        raise MeshtronError(f"parallel.schedule=zb-v places two chunks per stage in a V: "
                            f"parallel.vpp must be 2, not {pins.vpp}")
    if pins.vpp and pins.vpp > 1 and pins.pp == 1:
        raise MeshtronError(f"parallel.vpp={pins.vpp} needs a pipeline: parallel.pp=1 has no "
                            "stages to interleave")
    if pins.ep and pins.ep > 1 and not cfg.model.is_moe:
        raise MeshtronError(f"parallel.ep={pins.ep} needs a mixture-of-experts model (set "
                            "model.moe.num_experts)")


def no_fit_message(result: SearchResult, cluster: Cluster, problem: Problem) -> str:
    limit = problem.memory_limit
    if not result.ranked:
        return result.refusal or (f"no layout of {cluster.gpus} GPUs divides this model and "
                                  "batch (check train.global_batch, the pins and --cluster.gpus)")
    best = min(result.ranked, key=lambda e: e.memory.peak)
    need = best.memory.peak
    scale = need / max(1.0, limit - problem.reserved_bytes)
    return (f"the model does not fit on {cluster.gpus} x {cluster.profile.name}: the layout "
            f"needing least memory ({best.candidate.describe()}) takes {need / 2**30:,.1f} GiB "
            f"per GPU, {(need - limit) / 2**30:,.1f} GiB over the {limit / 2**30:,.1f} GiB "
            f"there; about {scale:.1f}x the GPUs (or that much more memory per GPU) would fit")


def table(ranked: list[Estimate], top: int, tokens: float | None) -> list[str]:
    head = (f"{'#':>3} {'layout':<52} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} "
            f"{'MFU':>6} {'GiB/GPU':>8} {'fits':>5} bottleneck")
    lines = [head + ("  days" if tokens else "")]
    for i, e in enumerate(ranked[:top], 1):
        line = (f"{i:>3} {e.candidate.describe():<52} {e.step_time_s:>9.4g} "
                f"{e.tokens_per_s:>11,.0f} {e.tflops_per_gpu:>8.1f} {e.mfu:>6.1%} "
                f"{e.memory.peak / 2**30:>8.1f} {'yes' if e.fits else 'NO':>5} {e.bottleneck}")
        if tokens:
            line += f"  {tokens / e.tokens_per_s / 86400:,.1f}"
        lines.append(line)
    return lines


MEASURED_ORDER_STEPS = 3
"""``parallel.zb_v_measured_order`` in a written zb-v config: the cost model prices the order
made for each kind's seconds, which the run measures over steps 2 and 3 and then runs."""


def write_config(cfg: Config, best: Estimate, path: Path, gpus: int) -> Path:
    """The winner as a config ``meshtron train --config`` runs (on ``gpus`` ranks); zb-v
    re-ordered for the measured costs (the order the cost model priced) unless ``cfg`` says
    when."""
    chosen = apply(cfg, best.candidate)
    if best.candidate.schedule == "zb-v" and not chosen.parallel.zb_v_measured_order:
        chosen = dataclasses.replace(chosen, parallel=dataclasses.replace(
            chosen.parallel, zb_v_measured_order=MEASURED_ORDER_STEPS))
    header = (f"# meshtron tune: {best.candidate.describe()}, predicted "
              f"{best.step_time_s:.4g} s/step, {best.memory.peak / 2**30:.1f} GiB/GPU\n"
              f"# run it on {gpus} ranks: meshtron train --config {path.name} --nproc {gpus}"
              f" (or torchrun / srun with {gpus} processes)\n")
    path.write_text(header + yaml.safe_dump(chosen.to_dict(), sort_keys=False))
    return path


def check_table_arguments(args: argparse.Namespace) -> None:
    """--top, --tokens and the output files, before the search (a file that cannot be
    written used to fail after the table was printed)."""
    if args.top < 1:
        raise MeshtronError(f"--top must be at least 1 (rows of the table), got {args.top}")
    if args.tokens is not None and not (math.isfinite(args.tokens) and args.tokens > 0):
        raise MeshtronError(f"--tokens must be a positive number of tokens to train on, got "
                            f"{args.tokens:g}")
    for flag, given in (("--json", args.json), ("--output-config", args.output_config)):
        if given:
            check_output_file(Path(given), flag)


def run_tune(args: argparse.Namespace, extra: list[str]) -> int:
    """The ``tune`` command, after the CLI has parsed its arguments."""
    if args.calibrate:
        from meshtron.tune.calibrate_command import run_calibrate

        return run_calibrate(args.nproc, Path(args.output), args.quick, not args.no_probe)
    check_table_arguments(args)
    where, overrides = split_cluster(extra)
    cfg = load_config(args.config, overrides)
    cluster = cluster_of(where)
    given = given_fields(args.config, overrides)
    cfg, defaults = planning_defaults(cfg, given, cluster)
    if defaults:
        print(f"planning with {', '.join(defaults)} (unset; set them for your run)")
    pins = layout_pins_of(given)
    check_pins(cfg, pins, cluster)
    problem = problem_of(cfg, cluster)
    result = search(problem, pins, cfg)
    ranked = result.ranked
    if not ranked or not ranked[0].fits:
        raise MeshtronError(no_fit_message(result, cluster, problem))
    winner = ranked[0]
    if args.trial:  # the winner by measurement; the table and JSON keep the predicted order
        from meshtron.tune.trials import run_trials

        winner = run_trials(cfg, ranked, args.trial, args.nproc, args.trial_steps,
                            cluster.profile, Path(args.trial_dir) if args.trial_dir else None,
                            profile_source=str(where["gpu"]))[0]
    print(f"{problem.model.preset or 'model'} on {cluster.gpus} x {cluster.profile.name} "
          f"({cluster.profile.source}): {result.considered:,} candidates divide it; "
          f"{result.fitting:,} layouts fit in {problem.memory_limit / 2**30:,.1f} GiB per GPU "
          "(each with the least recompute that fits)")
    print("\n".join(table(ranked, args.top, args.tokens)))
    notes, confidence = plan_confidence(
        ranked[0].tflops_per_gpu, ranked[0].mfu, cluster.profile.name, problem.model.is_moe,
        cluster.profile.compute_units is None, problem.fp8 or problem.fp4)
    if notes:
        print("\n".join(notes))
    if args.json:
        payload = {"cluster": {"gpu": cluster.profile.name, "gpus": cluster.gpus,
                               "gpus_per_node": cluster.profile.gpus_per_node,
                               "source": cluster.profile.source},
                   "considered": result.considered, "fitting": result.fitting,
                   "candidates": [e.row() for e in ranked], "chosen": winner.row(),
                   "confidence": confidence}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.output_config:
        path = write_config(cfg, winner, Path(args.output_config), cluster.gpus)
        print(f"wrote {path}: meshtron train --config {path} --nproc {cluster.gpus}",
              file=sys.stderr)
    return 0
