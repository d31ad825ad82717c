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
import json
import logging
import os
import signal
import socket
import sys
import textwrap
import time
from dataclasses import fields
from typing import Any, Iterator

from healthagent import __version__
from healthagent.check_report import (EXIT_CANNOT_RUN, check_exit_code, check_json, collect_once, gpu_scope_report,
                                      render_check)
from healthagent.cli_inputs import (CannotRun, InputUnreadable, choose_state_file, classify_input, dry_run_node_name,
                                    in_a_pod, named_kernel_log_problem, open_lines, state_file_given, summary)
from healthagent.cli_token import training_token
from healthagent.config import ConfigError, Settings, load_settings
from healthagent.demo import DEMO_GPUS

EXIT_USAGE = EXIT_CANNOT_RUN  # a usage error is "could not run", never check's 2 ("node action")
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a Unix tool whose reader left
DEMO_FABRICS = ("efa", "ib")  # ``demo --fabric``: the demo node's network
DEMO_XID = 94  # ``demo --xid``'s default: a contained memory error
DEMO_DRA_XID = 48  # ``demo --dra``'s XID: an uncorrectable ECC error, cleared by a GPU reset


class _Help(argparse.HelpFormatter):
    """argparse's help without breaking words at hyphens ("in-cluster", "dry-run" stay whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors exiting 3 (argparse's own 2 is check's "node action required"),
    and an unknown flag after a command shown with that command's usage: ``check --bogus`` is a
    mistake about ``check``, and its usage is the one that lists what ``check`` accepts."""

    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            owner.error("unrecognized arguments: " + " ".join(extras))
        return parsed


def _default(name: str) -> str:
    """A setting's default as ``--help`` shows it: read from ``Settings``, so the help cannot
    drift from what the agent does."""
    value = next(f.default for f in fields(Settings) if f.name == name)
    return "unset" if value in (None, "") else str(value).lower() if isinstance(value, bool) else str(value)


def _demo_gpu(text: str) -> int:
    index = _whole_number(text)
    if not 0 <= index < DEMO_GPUS:
        raise argparse.ArgumentTypeError(f"{text!r}: the demo node has GPUs 0 to {DEMO_GPUS - 1}")
    return index


def _xid_or_code(text: str) -> int | str:
    """``explain``'s subject: an XID number, a finding code (upper case) or a ConnectX adapter
    event id of the mlx5 catalog (lower case), each accepted in any case."""
    # deferred: the explain subject's tables load only when explain runs
    from healthagent.policy.findings import FINDING_CODES
    from healthagent.policy.mlx5_catalog import event_ids

    code = text.strip().upper()
    if code in FINDING_CODES:
        return code
    if text.strip().lower() in event_ids():
        return text.strip().lower()
    if text.strip().lstrip("-").isdigit():
        return _whole_number(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not an XID number, a finding code or a ConnectX adapter event "
                                     "id; use e.g. 94, GPU_NVLINK_ERRORS or module_bad_cable (docs/findings.md "
                                     "lists the codes and, under RDMA_ADAPTER_EVENT, the event ids)")


def _whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _add_host_flags(p: argparse.ArgumentParser, log_level: str) -> None:
    p.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    p.add_argument("--host-root", metavar="DIR",
                   help=f"where the host's /sys, /dev/kmsg and logs are (default {_default('host_root')})")
    p.add_argument("--kernel-log", metavar="FILE", help="read this kernel-log file instead of dev/kmsg")
    p.add_argument("--policy-file", metavar="FILE", help="YAML policy overrides (default: none)")
    p.add_argument("--dcgm-url", metavar="URL", help="dcgm-exporter /metrics URL (default: off)")
    p.add_argument("--expected-gpus", metavar="N",
                   help="GPUs this node must have (default: from the instance type, else not checked)")
    p.add_argument("--expected-efa-devices", metavar="N",
                   help="EFA devices this node must have (p5.48xlarge: 32; default: not checked, or the "
                        "instance type's with --set efa_expected_from_instance_type=true)")
    p.add_argument("--no-nvml", dest="nvml", action="store_const", const="false",
                   help="do not read NVML (no driver on this host)")
    p.add_argument("--log-level", metavar="LEVEL", help=f"DEBUG, INFO, WARNING or ERROR (default {log_level})")
    p.add_argument("--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting by its name, as in the YAML file (an unknown name lists them all), "
                        "e.g. --set source_timeout_seconds=10; repeatable; a dedicated flag wins")


STATE_FILE_HELP = (f"state that survives restarts (default in a pod: {_default('state_file')}, the DaemonSet's "
                   "hostPath; outside a pod: $XDG_STATE_HOME/healthagent/state.json, else "
                   "~/.local/state/healthagent/state.json, so a trial run never writes the file an agent "
                   "of the DaemonSet on this node owns)")


CHECK_EXIT_CODES = ("exit codes: 0 healthy; 1 degraded (monitor to reset_gpu: the node stays in); 2 node action "
                    "required (reboot_node or replace_node); 3 could not run (a usage, config or input error, or "
                    "the GPUs could not be observed while NVML was asked for and nothing seen demands a node action)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="healthagent",
        description="GPU, EFA and InfiniBand/RoCE health agent: detect faults, explain them, take the node out "
                    "safely.",
    )
    parser.add_argument("--version", action="version", version=f"healthagent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="the DaemonSet agent loop")
    _add_host_flags(run, _default("log_level"))
    run.add_argument("--listen", metavar="HOST:PORT",
                     help=f"where /metrics, /healthz and /readyz are served (default {_default('listen')})")
    run.add_argument("--training-listen", metavar="HOST:PORT",
                     help="where the training intake, POST /v1/training, is served (default: listen's "
                          "host, two ports above listen's: 9412 beside 9410)")
    run.add_argument("--training-intake", choices=("token", "open", "off"),
                     help=f"who may post training reports (default {_default('training_intake')}: a job "
                          "token or the training key)")
    run.add_argument("--kube", metavar="MODE",
                     help=f"in-cluster, kubeconfig, dry-run or off (default {_default('kube')})")
    run.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig file when --kube kubeconfig")
    run.add_argument("--node-name", help="this node's name (default: NODE_NAME; outside a pod with --kube dry-run, "
                                         "this host's name); needed by every --kube mode but off")
    run.add_argument("--state-file", metavar="FILE", help=STATE_FILE_HELP)
    run.add_argument("--hyperpod-labels", action="store_const", const="true",
                     help="also set sagemaker.amazonaws.com/node-health-status")

    check = sub.add_parser("check", help="collect once, classify, print the verdict (exit 0/1/2/3)",
                           description="Collect once from every source, classify, print the verdict.",
                           epilog=CHECK_EXIT_CODES)
    _add_host_flags(check, "ERROR")
    check.add_argument("--json", action="store_true", help="print JSON for machines")

    classify = sub.add_parser(
        "classify", help="classify XID, SXid and ConnectX (mlx5) lines of kernel-log text, one JSON object per event",
        description="One JSON object per XID, SXid or ConnectX (mlx5_core) adapter event line on stdout; how "
                    "many lines were read and how many were events goes to stderr. With no file and no "
                    "--host-root it reads standard input (saying so when that is a terminal).")
    classify.add_argument("file", nargs="?",
                          help="dmesg/journalctl/kmsg text, - for stdin (default: the kernel log under "
                               "--host-root when it is given, else stdin)")
    classify.add_argument("--host-root", metavar="DIR",
                          help="the host root whose dev/kmsg is read when no file is given; its boot time "
                               "dates the lines' kernel stamps, as check and run do")
    classify.add_argument("--policy-file", metavar="FILE", help="YAML policy overrides (default: none)")

    explain = sub.add_parser("explain", help="what an XID, a finding code or a ConnectX adapter event means "
                                             "and what the agent does about it")
    explain.add_argument("subject", type=_xid_or_code, metavar="XID|CODE|EVENT",
                         help="an XID number (e.g. 94), a finding code (e.g. GPU_NVLINK_ERRORS) for the rule "
                              "that opens it: the built-in one merged with the policy file, or a ConnectX "
                              "(mlx5) adapter event id (e.g. module_bad_cable)")
    explain.add_argument("--policy-file", metavar="FILE", help="YAML policy overrides (default: none)")
    explain.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    explain.add_argument("--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE",
                         help="a setting, e.g. --set condition_vocabulary=eks or --set hyperpod_labels=true "
                              "(what a replacement engine does depends on them); repeatable")

    demo = sub.add_parser("demo", help="run the agent on the bundled demo node through a scripted fault")
    demo.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                      help="where the demo agent serves /metrics (default: a free loopback port)")
    demo.add_argument("--fabric", choices=DEMO_FABRICS, default="efa",
                      help="the demo node's network: efa, a p5.48xlarge with 32 EFA devices, through an XID "
                           "(default); ib, a DGX H100 with 8 InfiniBand ports (one per GPU) and 2 RoCE ports, "
                           "through an InfiniBand port going down")
    demo.add_argument("--xid", type=_whole_number, default=None,
                      help=f"XID to inject (default {DEMO_XID}; --fabric efa only)")
    demo.add_argument("--gpu", type=_demo_gpu, default=3,
                      help="GPU index to inject it on, 0-7 (default 3); with --fabric ib, the port beside this "
                           "GPU goes down")
    demo.add_argument("--dra", action="store_true",
                      help=f"quarantine the one bad GPU through a DRA DeviceTaintRule (dry-run) while the node "
                           f"stays in the job: XID {DEMO_DRA_XID} on --gpu, then a GPU reset lifts it")
    demo.add_argument("--keep-running", action="store_true",
                      help="keep serving /metrics after the script, until Ctrl-C")
    demo.add_argument("--prepare", metavar="DIR",
                      help="only write the demo host root to DIR (for check/run --host-root DIR): a new or "
                           "empty folder, or one --prepare wrote before (written again)")
    demo.add_argument("--replace", action="store_true",
                      help="with --prepare: replace a demo node of the other --fabric in DIR")

    token = sub.add_parser("training-token", help="print the token that lets a training job report "
                                                  "(derived from the training key; docs/training.md)")
    token.add_argument("job", help="the job name its ranks report (HEALTHAGENT_JOB)")
    token.add_argument("--namespace", help="print a Secret for this namespace (for kubectl apply -f -) "
                                           "holding the job and its token, instead of the bare token")
    token.add_argument("--name", help="the Secret's name (default healthagent-job-<job>)")
    token.add_argument("--config", help="YAML settings file (also HEALTHAGENT_CONFIG)")
    parser.commands = dict(sub.choices)
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

def _catalog(policy_file: str | None, settings: Settings | None = None):
    """The policy and the catalog merged with it; with ``settings``, the rules' windows are checked
    against the reading intervals as ``run`` checks them."""
    # deferred: the policy and the catalog load only when classify or explain runs
    from healthagent.policy.catalog import load_catalog
    from healthagent.policy.debounce_file import reading_intervals
    from healthagent.policy.settings import load_policy

    policy = load_policy(policy_file, reading_intervals(settings) if settings is not None else None)
    return policy, load_catalog(policy)


STDIN_NOTE = ("classify: reading kernel-log text from standard input: paste lines, then Ctrl-D "
              "(or pass a file: healthagent classify /var/log/kern.log; dmesg | healthagent classify)")


def cmd_classify(args: argparse.Namespace) -> int:
    """One JSON object per XID, SXid or mlx5 adapter event line on stdout; on stderr, how many
    lines were read and how many were events (so an empty stdout says "none found", not "nothing
    read")."""
    # deferred: the ConnectX wording and the offline log reader load only when classify runs
    from healthagent.policy.mlx5_catalog import load_mlx5_catalog
    from healthagent.present.mlx5_words import classify_row
    from healthagent.sources.kernel_log.offline import iter_classifiable

    policy, catalog = _catalog(args.policy_file)
    mlx5 = load_mlx5_catalog(policy.mlx5_actions)
    source = classify_input(args.file, args.host_root)
    if source.path == "-" and sys.stdin.isatty():  # else a terminal waits in silence for the paste
        print(STDIN_NOTE, file=sys.stderr, flush=True)
    read = 0

    def counted() -> Iterator[str]:
        nonlocal read
        for line in open_lines(source.path):
            read += 1
            yield line

    found = {"xid": 0, "sxid": 0, "mlx5": 0}
    try:
        for event in iter_classifiable(counted(), time.time(), host_root=args.host_root or "/"):
            kind, row = classify_row(event, catalog, mlx5)
            found[kind] += 1
            print(json.dumps(row, sort_keys=True))
    except InputUnreadable as exc:
        raise CannotRun(str(exc)) from None
    sys.stdout.flush()  # the rows before the summary, when both go to one terminal
    print(summary(found["xid"], found["sxid"], read, source.where, adapter_events=found["mlx5"]), file=sys.stderr)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """The XID, the agent's action and what the repair engines do with it, under the settings the
    agent has (HEALTHAGENT_* in its pod, the settings file, --set): the condition vocabulary and
    HyperPod's labels decide which engine acts. A finding code: the rule that opens it, each
    field saying whether it is built in or which key of the policy file set it. A ConnectX event
    id: its catalog row with the policy file's ``mlx5:`` override, as the agent applies it."""
    # deferred: explain's wording loads only when explain runs
    from healthagent.policy.findings import FINDING_CODES
    from healthagent.present.explain import explain
    from healthagent.present.explain_code import explain_code

    settings = _settings(args)
    policy, catalog = _catalog(settings.policy_file, settings)
    if isinstance(args.subject, str) and args.subject not in FINDING_CODES:
        # deferred: the ConnectX catalog's wording loads only for a ConnectX event id
        from healthagent.policy.mlx5_catalog import load_mlx5_catalog
        from healthagent.present.mlx5_words import explain_mlx5

        print(explain_mlx5(args.subject, load_mlx5_catalog(policy.mlx5_actions), policy))
        return 0
    if isinstance(args.subject, str):
        print(explain_code(args.subject, policy))
        return 0
    print(explain(args.subject, catalog, policy, vocabulary=settings.condition_vocabulary,
                  hyperpod_labels=settings.hyperpod_labels))
    return 0


# -- check ----------------------------------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    settings = _settings(args)
    problem = named_kernel_log_problem(settings.kernel_log)
    if problem:
        raise CannotRun(f"check: {problem}")
    _setup_logging(settings.log_level if args.log_level else "ERROR")
    # deferred: the agent's parts (about 0.4 s to import) load only for check, run and demo
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
        scope = classifier.policy.scope
        print(render_check(collection, verdict, code, earlier, scope=scope,
                           gpu_scope=gpu_scope_report(settings, verdict, scope)))
    return code


# -- run / demo -----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    """``healthagent run``: start, wait for SIGTERM/SIGINT, finish the write in flight, exit 0.

    Outside a pod, with no state file named, the state goes to the user's state directory, and a
    dry run with no node name reports as this host; one log line says each (``cli_inputs`` says
    why)."""
    settings = _settings(args)
    given = state_file_given(args.state_file, parse_set_values(args.set_values), os.environ, args.config)
    in_pod = in_a_pod(os.environ)
    choice = choose_state_file(given, in_pod, os.environ, os.path.expanduser("~"))
    node = dry_run_node_name(settings.kube, settings.node_name, in_pod, socket.gethostname())
    overrides = {**({"state_file": choice.path} if choice.path else {}),
                 **({"node_name": node.name} if node.name else {})}
    if overrides:
        settings = _settings(args, **overrides)
    _setup_logging(settings.log_level)
    for note in (choice.note, node.note):
        if note:
            logging.getLogger(__name__).info(note)
    # deferred: the agent's parts (about 0.4 s to import) load only for check, run and demo
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
    # deferred: the demo (its stub NVML, its scripts and the agent) loads only when demo runs
    from healthagent.demo.prepare import PrepareRefused
    from healthagent.demo.command import run_demo
    from healthagent.demo.stub_nvml import StubBuildError

    if args.fabric == "ib" and args.xid is not None:
        raise CannotRun("demo: --xid is the efa demo's fault; the ib demo's fault is an InfiniBand port "
                        "going down (--gpu picks the GPU whose port it is): leave out --xid, or use --fabric efa")
    if args.dra and (args.fabric == "ib" or args.prepare):
        raise CannotRun("demo: --dra runs the EFA node's script with one GPU quarantined alone; leave out "
                        "--fabric ib and --prepare")
    if args.dra and args.xid not in (None, DEMO_DRA_XID):
        raise CannotRun(f"demo: --dra shows XID {DEMO_DRA_XID}, whose DBE count a GPU reset visibly clears in "
                        f"NVML; leave out --xid (XID {args.xid} is not the --dra demo's)")
    if args.replace and not args.prepare:
        raise CannotRun("demo: --replace goes with --prepare DIR (it replaces the demo node in DIR)")
    if args.xid is None:
        args.xid = DEMO_DRA_XID if args.dra else DEMO_XID
    try:
        return run_demo(args)
    except PrepareRefused as exc:
        raise CannotRun(str(exc)) from None
    except StubBuildError as exc:  # the demo's GPUs are a stub library compiled from C on this machine
        raise CannotRun(f"demo: {' '.join(str(exc).split())[:400]}; or try the node without GPUs: "
                        "healthagent demo --prepare DIR, then healthagent check --host-root DIR --no-nvml") from None


def cmd_training_token(args: argparse.Namespace) -> int:
    return training_token(args)


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
    except OSError as exc:  # a file, folder or device the command could not use
        where = f": {exc.filename}" if exc.filename else ""
        print(f"healthagent: {args.command}: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as exc:  # policy file errors: one line, exit 3; anything else too, said as a bug
        if type(exc).__name__ in ("PolicyError",):
            print(f"healthagent: policy error: {exc}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        logging.getLogger(__name__).debug("%s failed", args.command, exc_info=True)  # --log-level DEBUG
        print(f"healthagent: {args.command}: unexpected {type(exc).__name__}: {' '.join(str(exc).split())[:200]} "
              "(a bug: please report it)", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
