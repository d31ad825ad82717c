"""Command line: ``healthagent run|check|classify|explain|demo`` (the stable CLI of ARCHITECTURE.md).

Exit codes of ``check``: 0 healthy, 1 degraded (monitor..reset_gpu), 2 node action required
(reboot_node, replace_node), 3 could not run. Config errors print one line naming the key and the
fix and exit 3 for every command.

Imports of heavy or cluster-only modules (``kubernetes``, ``grafanalib``) stay inside the commands
that need them, so ``check`` and ``classify`` start fast on a bare node image.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import asdict
from typing import Any, Iterable

from healthagent import __version__
from healthagent.config import ConfigError, Settings, load_settings

EXIT_CANNOT_RUN = 3


def _add_host_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    p.add_argument("--host-root", help="where the host's /sys, /dev/kmsg and logs are (default /)")
    p.add_argument("--kernel-log", help="read this kernel-log file instead of dev/kmsg")
    p.add_argument("--policy-file", help="YAML policy overrides")
    p.add_argument("--dcgm-url", help="dcgm-exporter /metrics URL (off unless set)")
    p.add_argument("--expected-gpus", help="GPUs this node must have")
    p.add_argument("--expected-efa-devices", help="EFA devices this node must have (p5.48xlarge: 32)")
    p.add_argument("--no-nvml", dest="nvml", action="store_const", const="false",
                   help="do not read NVML (no driver on this host)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthagent",
        description="GPU and EFA health agent: detect faults, explain them, take the node out safely.",
    )
    parser.add_argument("--version", action="version", version=f"healthagent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="the DaemonSet agent loop")
    _add_host_flags(run)
    run.add_argument("--listen", help="HOST:PORT for /metrics, /healthz, /readyz, /v1/training")
    run.add_argument("--kube", help="in-cluster, kubeconfig, dry-run or off")
    run.add_argument("--kubeconfig", help="kubeconfig file when --kube kubeconfig")
    run.add_argument("--node-name", help="this node's name (default: NODE_NAME)")
    run.add_argument("--state-file", help="state that survives restarts")
    run.add_argument("--hyperpod-labels", action="store_const", const="true",
                     help="also set sagemaker.amazonaws.com/node-health-status")

    check = sub.add_parser("check", help="collect once, classify, print the verdict (exit 0/1/2/3)")
    _add_host_flags(check)
    check.add_argument("--json", action="store_true", help="print JSON for machines")

    classify = sub.add_parser(
        "classify", help="classify XID lines of kernel-log text, one JSON object per event")
    classify.add_argument("file", nargs="?", default="-", help="dmesg/journalctl/kmsg text, - for stdin")
    classify.add_argument("--policy-file", help="YAML policy overrides")

    explain = sub.add_parser("explain", help="what an XID means and what the agent does about it")
    explain.add_argument("xid", type=int)
    explain.add_argument("--policy-file", help="YAML policy overrides")

    demo = sub.add_parser("demo", help="run the agent on the bundled demo node through a scripted fault")
    demo.add_argument("--listen", default="127.0.0.1:0",
                      help="where the demo agent serves /metrics (default: a free loopback port)")
    demo.add_argument("--xid", type=int, default=94, help="XID to inject (default 94)")
    demo.add_argument("--gpu", type=int, default=3, help="GPU index to inject it on (default 3)")
    demo.add_argument("--keep-running", action="store_true",
                      help="keep serving /metrics after the script, until Ctrl-C")
    demo.add_argument("--prepare", metavar="DIR",
                      help="only write the demo host root to DIR (for check/run --host-root DIR)")
    return parser


_SETTING_FLAGS = ("host_root", "kernel_log", "policy_file", "dcgm_url", "expected_gpus",
                  "expected_efa_devices", "nvml", "log_level", "listen", "kube", "kubeconfig",
                  "node_name", "state_file", "hyperpod_labels")


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    flags = {k: getattr(args, k) for k in _SETTING_FLAGS if getattr(args, k, None) is not None}
    flags.update(overrides)
    return load_settings(flags=flags, config_file=getattr(args, "config", None))


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


# -- classify / explain ---------------------------------------------------------------------------

def _catalog(policy_file: str | None):
    from healthagent.policy.catalog import load_catalog
    from healthagent.policy.settings import load_policy

    policy = load_policy(policy_file)
    return policy, load_catalog(policy)


def cmd_classify(args: argparse.Namespace) -> int:
    from healthagent.policy.classify import classify_event
    from healthagent.sources.kmsg import iter_events

    _, catalog = _catalog(args.policy_file)
    stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8", errors="replace")
    with stream:
        for event in iter_events(stream, time.time()):
            print(json.dumps(classify_event(event, catalog), sort_keys=True))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from healthagent.policy.classify import explain

    policy, catalog = _catalog(args.policy_file)
    print(explain(args.xid, catalog, policy))
    return 0


# -- check ----------------------------------------------------------------------------------------

def collect_once(settings: Settings):
    """One collection from every configured source, as ``check`` and the demo show it."""
    from healthagent.agent import build_sources
    from healthagent.model import Collection

    now = time.time()
    scheduled, event_sources, nvml = build_sources(settings)
    results = [item.source.collect(now) for item in scheduled]
    results += [source.collect(now) for source in event_sources]
    for source in [item.source for item in scheduled] + event_sources:
        source.close()
    gpus = next((r.gpus for r in results if r.gpus and r.health.source == "nvml"), None) or next(
        (r.gpus for r in results if r.gpus), ())
    from healthagent.agent import enrich_xid

    xids = tuple(enrich_xid(x, gpus) for r in results for x in r.xids)
    return Collection(
        timestamp=now, gpus=gpus, xids=xids, efa=tuple(s for r in results for s in r.efa),
        health=tuple(r.health for r in results), expected_gpus=settings.expected_gpus,
        expected_efa_devices=settings.expected_efa_devices,
    )


def _table(rows: Iterable[Iterable[Any]], header: list[str]) -> str:
    rows = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _natural_key(name: str) -> tuple:
    """Sort ``rdmap79s0`` before ``rdmap113s0`` (numbers by value), as a person reads them."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _finding_subject(f) -> str:
    if f.gpu_index is not None:
        return f"GPU {f.gpu_index} ({f.pci_bus_id})" if f.pci_bus_id else f"GPU {f.gpu_index}"
    return f.pci_bus_id or f.efa_device or "node"


def render_check(collection, verdict) -> str:
    """The report a person reads on a suspect node: what was read, then each finding as a block
    (what, why, the evidence, what to do next), most severe first."""
    lines = [f"GPUs: {len(collection.gpus)} read"]
    lines.append(_table(
        ([g.index, g.pci_bus_id, g.uuid, g.name, "LOST" if g.lost else "ok", g.temperature_c,
          g.power_w, g.ecc.aggregate_uncorrected, g.remap.pending, g.remap.failure]
         for g in collection.gpus),
        ["GPU", "PCI", "UUID", "MODEL", "STATE", "TEMP_C", "POWER_W", "DBE_AGG", "REMAP_PENDING",
         "REMAP_FAILURE"]))
    devices = sorted({s.device for s in collection.efa}, key=_natural_key)
    lines.append("")
    lines.append(f"EFA devices: {len(devices)} read" + (f" ({devices[0]} .. {devices[-1]})" if devices else ""))
    lines.append("Sources:")
    lines.extend(f"  {h.source:<5} {'up' if h.up else 'DOWN':<4} {h.detail}".rstrip()
                 for h in collection.health)
    lines.append(f"XID events in the kernel log / NVML: {len(collection.xids)}")
    lines.append("")
    meaning = {0: "healthy", 1: "degraded", 2: "node action required"}[verdict.exit_code]
    lines.append(f"Verdict: {verdict.action.value} ({meaning})")
    for f in verdict.findings:
        lines.append("")
        lines.append(f"[{f.action.value}] {f.code} on {_finding_subject(f)}")
        lines.append(f"  what: {f.summary}")
        lines.append(f"  seen: {f.evidence}")
        lines.append(f"  next: {f.next_steps}")
    return "\n".join(lines)


def check_json(collection, verdict) -> dict[str, Any]:
    def finding(f):
        d = asdict(f)
        d["action"] = f.action.value
        return d

    return {
        "verdict": verdict.action.value,
        "exit_code": verdict.exit_code,
        "findings": [finding(f) for f in verdict.findings],
        "gpus": [asdict(g) for g in collection.gpus],
        "efa_devices": sorted({s.device for s in collection.efa}),
        "sources": [asdict(h) for h in collection.health],
        "xid_events": len(collection.xids),
    }


def cmd_check(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level if args.log_level else "ERROR")
    from healthagent.agent import build_classifier

    classifier = build_classifier(settings)
    collection = collect_once(settings)
    verdict = classifier.observe(collection)
    if args.json:
        print(json.dumps(check_json(collection, verdict), indent=2, sort_keys=True, default=str))
    else:
        print(render_check(collection, verdict))
    return verdict.exit_code


# -- run / demo -----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level)
    from healthagent.agent import run_agent

    return run_agent(settings)


def cmd_demo(args: argparse.Namespace) -> int:
    from healthagent.demo.script import run_demo

    return run_demo(args)


COMMANDS = {"run": cmd_run, "check": cmd_check, "classify": cmd_classify, "explain": cmd_explain,
            "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"healthagent: config error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as exc:  # policy file errors and the like: one line, exit 3
        if type(exc).__name__ in ("PolicyError",):
            print(f"healthagent: policy error: {exc}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
