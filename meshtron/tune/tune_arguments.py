"""The ``meshtron tune`` command line: its flags and help, without importing the tuner (so that
``meshtron --help`` stays instant)."""

from __future__ import annotations

import argparse

from meshtron.config.parse import OnceAction

TUNE_EPILOG = """\
plan (the config fields as for train; parallel.*, train.micro_batch and train.recompute pin the
search):
  meshtron tune --model.preset=llama3-70b --train.global_batch=1024 --train.seq_len=8192 \\
      --precision.dtype=bf16 --cluster.gpu=h100-sxm --cluster.gpus=512 --top 10 \\
      --json plan.json --output-config plan.yaml
  --cluster.gpu         a100-40gb, a100-80gb, h100-sxm, h100-hbm2e, h200, b200, gb200,
                        or a profile .json
  --cluster.gpus        GPUs in all; --cluster.gpus_per_node (default: the profile's, 8)
calibrate this machine, then check the plan by trial runs of the real trainer:
  meshtron tune --calibrate --nproc 4 --output here.json
  meshtron tune --model.preset=tiny --cluster.gpu=here.json --cluster.gpus=4 --trial 3 --nproc 4
See docs/tuning.md."""



def cmd_tune(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.tune.tune_command import run_tune

    return run_tune(args, extra)


def add_tune_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="plan the parallel layout of a run on a cluster (cost model + search)",
        description="Search tp, cp, pp (schedule, vpp), ep, dp, ZeRO, micro-batch and recompute "
        "for the fastest layout that fits,\npriced by a cost model of time and memory; "
        "--calibrate measures this machine, --trial runs the best.",
        epilog=TUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action=OnceAction,
                   help="YAML config (model, batch, precision; parallel pins)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", help="write every priced candidate to this JSON file")
    p.add_argument("--output-config", help="write the winner as a config YAML for train")
    p.add_argument("--tokens", type=float,
                   help="tokens to train on: the table adds days to train (e.g. 15e12)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine and write a profile (--output)")
    p.add_argument("--output", default="profile.json",
                   help="--calibrate: the profile to write (default profile.json)")
    p.add_argument("--quick", action="store_true", help="--calibrate: fewer, shorter probes")
    p.add_argument("--no-probe", action="store_true",
                   help="--calibrate: skip the probe training runs (kernels and links only)")
    p.add_argument("--nproc", type=int, default=1,
                   help="local processes for --calibrate and --trial (default 1)")
    p.add_argument("--trial", type=int, default=0, metavar="K",
                   help="run the best K candidates for a few steps and pick by measurement")
    p.add_argument("--trial-steps", type=int, default=6,
                   help="steps of each trial run (default 6; the first is warm-up)")
    p.add_argument("--trial-dir", help="where trial runs go (default: a temporary folder)")
    p.set_defaults(func=cmd_tune)
    return p
