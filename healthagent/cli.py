"""Command line: ``healthagent run|check|classify|explain|demo|training-token`` (a stable
contract: people and scripts rely on it).

Exit codes of ``check``: 0 healthy, 1 degraded (monitor..reset_gpu), 2 node action required
(reboot_node, replace_node), 3 could not run (a usage or config error, or the GPUs could not be
observed while NVML was asked for and nothing seen demands a node action). Every command exits 3
when it could not run: a usage error (an unknown flag, a value of the wrong kind) prints the usage
and one line; a config error prints one line naming the key and the fix. So a wrapper that acts
on 2 never acts on a typo.

Imports of heavy or cluster-only modules (``kubernetes``, ``grafanalib``) stay inside the commands
that need them, so ``check`` and ``classify`` start fast on a bare node image.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import asdict, fields
from typing import Any, Iterable

from healthagent import __version__
from healthagent.config import ConfigError, Settings, load_settings
from healthagent.model import Collection, natural_key

EXIT_CANNOT_RUN = 3
EXIT_USAGE = EXIT_CANNOT_RUN  # a usage error is "could not run", never check's 2 ("node action")
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a Unix tool whose reader left


class CannotRun(Exception):
    """A command cannot do its job (an input file that cannot be read); ``str()`` is one line."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors exiting 3 (argparse's own 2 is check's "node action required")."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _demo_gpu(text: str) -> int:
    from healthagent.demo import DEMO_GPUS

    index = _whole_number(text)
    if not 0 <= index < DEMO_GPUS:
        raise argparse.ArgumentTypeError(f"{text!r}: the demo node has GPUs 0 to {DEMO_GPUS - 1}")
    return index


def _whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


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
    p.add_argument("--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting by its name, as in the YAML file (an unknown name lists them all), "
                        "e.g. --set source_timeout_seconds=10; repeatable; a dedicated flag wins")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="healthagent",
        description="GPU and EFA health agent: detect faults, explain them, take the node out safely.",
    )
    parser.add_argument("--version", action="version", version=f"healthagent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="the DaemonSet agent loop")
    _add_host_flags(run)
    run.add_argument("--listen", help="HOST:PORT for /metrics, /healthz and /readyz (default 0.0.0.0:9410)")
    run.add_argument("--training-listen", help="HOST:PORT of the training intake, POST /v1/training "
                                               "(default: listen's host, port 9412)")
    run.add_argument("--training-intake", choices=("token", "open", "off"),
                     help="who may post training reports (default token: a job token or the training key)")
    run.add_argument("--kube", help="in-cluster, kubeconfig, dry-run or off")
    run.add_argument("--kubeconfig", help="kubeconfig file when --kube kubeconfig")
    run.add_argument("--node-name", help="this node's name (default: NODE_NAME); needed by every --kube mode but off")
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
    explain.add_argument("xid", type=_whole_number, help="the XID number, e.g. 94")
    explain.add_argument("--policy-file", help="YAML policy overrides")
    explain.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    explain.add_argument("--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE",
                         help="a setting, e.g. --set condition_vocabulary=eks or --set hyperpod_labels=true "
                              "(what a replacement engine does depends on them); repeatable")

    demo = sub.add_parser("demo", help="run the agent on the bundled demo node through a scripted fault")
    demo.add_argument("--listen", default="127.0.0.1:0",
                      help="where the demo agent serves /metrics (default: a free loopback port)")
    demo.add_argument("--xid", type=_whole_number, default=94, help="XID to inject (default 94)")
    demo.add_argument("--gpu", type=_demo_gpu, default=3, help="GPU index to inject it on, 0-7 (default 3)")
    demo.add_argument("--keep-running", action="store_true",
                      help="keep serving /metrics after the script, until Ctrl-C")
    demo.add_argument("--prepare", metavar="DIR",
                      help="only write the demo host root to DIR (for check/run --host-root DIR)")

    token = sub.add_parser("training-token", help="print the token that lets a training job report "
                                                  "(derived from the training key; docs/training.md)")
    token.add_argument("job", help="the job name its ranks report (HEALTHAGENT_JOB)")
    token.add_argument("--namespace", help="print a Secret for this namespace (for kubectl apply -f -) "
                                           "holding the job and its token, instead of the bare token")
    token.add_argument("--name", help="the Secret's name (default healthagent-job-<job>)")
    token.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    return parser


_SETTING_FLAGS = ("host_root", "kernel_log", "policy_file", "dcgm_url", "expected_gpus",
                  "expected_efa_devices", "nvml", "log_level", "listen", "kube", "kubeconfig",
                  "node_name", "state_file", "hyperpod_labels", "training_listen", "training_intake")


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    set_values = parse_set_values(getattr(args, "set_values", None) or [])
    flags = {k: getattr(args, k) for k in _SETTING_FLAGS if getattr(args, k, None) is not None}
    flags.update(overrides)
    return load_settings(flags=flags, set_values=set_values, config_file=getattr(args, "config", None))


def parse_set_values(items: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items for ``load_settings`` (which converts and validates the values
    exactly as it does the YAML file's and the environment's, and names them ``--set KEY``)."""
    known = {f.name for f in fields(Settings)}
    values: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE, e.g. --set source_timeout_seconds=10")
        if key not in known:
            raise ConfigError(f"--set {item!r}: {key!r} is not a setting; valid keys: " + ", ".join(sorted(known)))
        values[key] = value
    return values


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
    from healthagent.sources.kernel_log.offline import iter_events

    _, catalog = _catalog(args.policy_file)
    if args.file == "-":
        # Decode stdin as the file path does: undecodable bytes become U+FFFD, never lone
        # surrogates (the locale's surrogateescape) that would leak into the JSON.
        stream = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    else:
        try:
            stream = open(args.file, encoding="utf-8", errors="replace")
        except OSError as exc:
            raise CannotRun(f"classify: cannot read {args.file!r} ({exc.strerror}); pass a file of "
                            "kernel-log text (dmesg, journalctl -k) or - for stdin") from None
    with stream:
        for event in iter_events(stream, time.time()):
            print(json.dumps(classify_event(event, catalog), sort_keys=True))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """The XID, the agent's action and what the repair engines do with it, under the settings the
    agent has (HEALTHAGENT_* in its pod, the settings file, --set): the condition vocabulary and
    HyperPod's labels decide which engine acts."""
    from healthagent.policy.classify import explain

    settings = _settings(args)
    policy, catalog = _catalog(settings.policy_file)
    print(explain(args.xid, catalog, policy, vocabulary=settings.condition_vocabulary,
                  hyperpod_labels=settings.hyperpod_labels))
    return 0


# -- check ----------------------------------------------------------------------------------------

def collect_once(settings: Settings) -> Collection:
    """One collection from every configured source, as ``check`` and the demo show it."""
    from healthagent.agent import enrich_xid
    from healthagent.wiring import build_sources, expected_inventory

    now = time.time()
    expected = expected_inventory(settings)  # configured, else from the instance type
    sources = build_sources(settings).all()
    results = [source.collect(now) for source in sources]
    for source in sources:
        source.close()
    gpus = next((r.gpus for r in results if r.gpus and r.health.source == "nvml"), None) or next(
        (r.gpus for r in results if r.gpus), ())
    xids = tuple(enrich_xid(x, gpus) for r in results for x in r.xids)
    return Collection(
        timestamp=now, gpus=gpus, xids=xids, efa=tuple(s for r in results for s in r.efa),
        health=tuple(r.health for r in results), expected_gpus=expected[0], expected_efa_devices=expected[1],
    )


def _table(rows: Iterable[Iterable[Any]], header: list[str]) -> str:
    rows = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _finding_subject(f) -> str:
    if f.gpu_index is not None:
        return f"GPU {f.gpu_index} ({f.pci_bus_id})" if f.pci_bus_id else f"GPU {f.gpu_index}"
    return f.pci_bus_id or f.efa_device or "node"


def check_exit_code(verdict, nvml_asked: bool) -> int:
    """``check``'s exit code: the verdict's 0/1/2, but 3 (could not run) when the GPUs could not be
    observed and NVML was asked for, because "no finding" about GPUs nobody saw is not "healthy".
    A finding that already demands a node action stands (2): what was seen is enough to act on."""
    if verdict.action.needs_node_action:
        return 2
    if "gpu" in verdict.unobserved and nvml_asked:
        return EXIT_CANNOT_RUN
    return verdict.exit_code


_UNOBSERVED_WORDS = {"gpu": ("GPUs could not be observed", ("nvml", "dcgm")),
                     "efa": ("EFA devices could not be observed", ("efa",)),
                     "kernel_log": ("The kernel log could not be read", ("kmsg",))}


def _unobserved_lines(collection, verdict) -> list[str]:
    lines = []
    for part in verdict.unobserved:
        title, sources = _UNOBSERVED_WORDS.get(part, (f"{part} could not be observed", ()))
        why = "; ".join(f"{h.source} {h.detail}".rstrip() for h in collection.health
                        if h.source in sources and not h.up)
        if not why and part == "gpu":
            why = f"no GPU source is configured, and {collection.expected_gpus} GPUs are expected"
        lines.append(f"{title}: {why or 'no source answered'}")
    return lines


def render_check(collection, verdict, exit_code: int | None = None, earlier_boot_xids: int = 0) -> str:
    """The report a person reads on a suspect node: what was read, what could not be seen, then
    each finding as a block (what, why, the evidence, what to do next), most severe first."""
    lines = [f"GPUs: {len(collection.gpus)} read"]
    lines.append(_table(
        ([g.index, g.pci_bus_id, g.uuid, g.name, "LOST" if g.lost else "ok", g.temperature_c,
          g.power_w, g.ecc.aggregate_uncorrected, g.remap.pending, g.remap.failure]
         for g in collection.gpus),
        ["GPU", "PCI", "UUID", "MODEL", "STATE", "TEMP_C", "POWER_W", "DBE_AGG", "REMAP_PENDING",
         "REMAP_FAILURE"]))
    devices = sorted({s.device for s in collection.efa}, key=natural_key)
    lines.append("")
    lines.append(f"EFA devices: {len(devices)} read" + (f" ({devices[0]} .. {devices[-1]})" if devices else ""))
    lines.append("Sources:")
    lines.extend(f"  {h.source:<5} {'up' if h.up else 'DOWN':<4} {h.detail}".rstrip()
                 for h in collection.health)
    lines.append(f"XID events in the kernel log / NVML: {sum(x.repeats for x in collection.xids)}")
    if earlier_boot_xids:
        lines.append(f"{earlier_boot_xids} XID events from earlier boots (not judged)")
    lines.extend(_unobserved_lines(collection, verdict))
    lines.append("")
    code = verdict.exit_code if exit_code is None else exit_code
    meaning = {0: "healthy", 1: "degraded", 2: "node action required", 3: "could not run"}[code]
    if verdict.unobserved and code in (0, 1):
        meaning += " as far as seen; not observed: " + ", ".join(verdict.unobserved)
    lines.append(f"Verdict: {verdict.action.value} ({meaning})")
    for f in verdict.findings:
        lines.append("")
        lines.append(f"[{f.action.value}] {f.code} on {_finding_subject(f)}")
        lines.append(f"  what: {f.summary}")
        lines.append(f"  seen: {f.evidence}")
        lines.append(f"  next: {f.next_steps}")
    return "\n".join(lines)


def check_json(collection, verdict, exit_code: int | None = None, earlier_boot_xids: int = 0) -> dict[str, Any]:
    def finding(f):
        d = asdict(f)
        d["action"] = f.action.value
        return d

    return {
        "verdict": verdict.action.value,
        "exit_code": verdict.exit_code if exit_code is None else exit_code,
        "unobserved": list(verdict.unobserved),
        "findings": [finding(f) for f in verdict.findings],
        "gpus": [asdict(g) for g in collection.gpus],
        "efa_devices": sorted({s.device for s in collection.efa}),
        "sources": [asdict(h) for h in collection.health],
        "xid_events": sum(x.repeats for x in collection.xids),
        "xid_events_earlier_boots": earlier_boot_xids,
    }


def cmd_check(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level if args.log_level else "ERROR")
    from healthagent.wiring import build_classifier

    classifier = build_classifier(settings)
    collection = collect_once(settings)
    assessment = classifier.observe(collection)
    verdict = assessment.verdict
    code = check_exit_code(verdict, nvml_asked=settings.nvml)
    earlier = len(assessment.earlier_boot_xids)
    if args.json:
        print(json.dumps(check_json(collection, verdict, code, earlier), indent=2, sort_keys=True, default=str))
    else:
        print(render_check(collection, verdict, code, earlier))
    return code


# -- run / demo -----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    """``healthagent run``: start, wait for SIGTERM/SIGINT, finish the write in flight, exit 0."""
    settings = _settings(args)
    _setup_logging(settings.log_level)
    from healthagent.wiring import AgentRuntime

    runtime = AgentRuntime(settings)

    def _stop(signum: int, _frame: Any) -> None:
        logging.getLogger(__name__).info("signal=%d stopping", signum)
        runtime.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    runtime.start(owns_process=True)
    while not runtime.stop_event.wait(1.0):
        pass
    runtime.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from healthagent.demo.script import run_demo

    return run_demo(args)


# -- training-token -------------------------------------------------------------------------------

def cmd_training_token(args: argparse.Namespace) -> int:
    """Print a job's token, or a Secret holding it: the one step that gives a job its credential.

    Run where the training key is (``kubectl -n healthagent exec ds/healthagent -- healthagent
    training-token JOB ...``: the agent's pod has it from the Secret healthagent-training)."""
    from healthagent.training.access import job_token
    from healthagent.training.schema import ReportError, parse_report

    settings = load_settings(config_file=args.config)
    if not settings.training_token:
        raise CannotRun("training-token: no training key here (training_token is empty); run it in an "
                        "agent's pod: kubectl -n healthagent exec ds/healthagent -- healthagent "
                        "training-token JOB, after creating the Secret healthagent-training "
                        "(docs/training.md)")
    try:
        parse_report({"type": "end", "job": args.job})  # the intake's own rule for a job name
    except ReportError as exc:
        raise CannotRun(f"training-token: {exc}") from None
    token = job_token(settings.training_token, args.job)
    if not args.namespace:
        print(token)
        return 0
    name = args.name or _secret_name(args.job)
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": name, "namespace": args.namespace,
                           "labels": {"app.kubernetes.io/part-of": "healthagent"}},
              "stringData": {"job": args.job, "token": token}}
    print(json.dumps(secret, indent=2))
    return 0


def _secret_name(job: str) -> str:
    """``healthagent-job-<job>`` as a Kubernetes object name (lower case, ``-`` for the rest)."""
    slug = re.sub(r"[^a-z0-9.-]+", "-", job.lower()).strip("-.")[:200].rstrip("-.")
    if not slug:
        raise CannotRun(f"training-token: {job!r} gives no usable Secret name; pass --name NAME")
    return f"healthagent-job-{slug}"


COMMANDS = {"run": cmd_run, "check": cmd_check, "classify": cmd_classify, "explain": cmd_explain,
            "demo": cmd_demo, "training-token": cmd_training_token}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"healthagent: config error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except CannotRun as exc:
        print(f"healthagent: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except BrokenPipeError:
        # The reader went away (``healthagent classify ... | head``): stop quietly, as Unix tools
        # do. Point stdout at /dev/null so the interpreter's last flush cannot complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # policy file errors and the like: one line, exit 3
        if type(exc).__name__ in ("PolicyError",):
            print(f"healthagent: policy error: {exc}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
