"""``healthagent training-token JOB``: print a job's token, or a Secret holding it (apart from
``cli.py``: the one command that handles the training key, with its own rules for names)."""

from __future__ import annotations

import argparse
import json
import re

from healthagent.cli_inputs import CannotRun
from healthagent.config import load_settings
from healthagent.training.access import job_token
from healthagent.training.schema import ReportError, parse_report


def training_token(args: argparse.Namespace) -> int:
    """Print a job's token, or a Secret holding it: the one step that gives a job its credential.

    Run where the training key is (``kubectl -n healthagent exec ds/healthagent -- healthagent
    training-token JOB ...``: the agent's pod has it from the Secret healthagent-training)."""
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
