"""docs/reference/settings.md: every setting of the agent and every key of its policy file, from the
code's own tables: the ``Settings`` dataclass (``healthagent/config.py``: default and help of each
key), the argparse parser (``healthagent/cli.py``: the flags of each command) and the policy file's
sections and thresholds (``healthagent/policy/settings.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, Iterator

from page_text import code, first_line, generated_note, item, wrap

from healthagent import cli
from healthagent.config import ENV_PREFIX, MAXIMA, Settings
from healthagent.policy.settings import MAX_BY_KIND, SECTIONS, THRESHOLDS

TARGET = Path(__file__).with_name("settings.md")
SOURCES = "`healthagent/config.py`, `healthagent/cli.py` and `healthagent/policy/settings.py`"
KINDS = {  # what each kind of threshold accepts (policy/settings.py validates them)
    "seconds": "seconds, 0 or more", "count": "a whole number of at least 1",
    "number": "a number, 0 or more", "factor": "a number of at least 1",
}


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, float):
        return code(f"{value:g}")
    return code(value)


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield from cli.build_parser().commands.items()


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    name = max(action.option_strings, key=len)
    metavar = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper())
    return code(f"{name} {metavar}" if action.nargs != 0 else name)  # a switch takes no value


def _setting_flags() -> dict[str, dict[str, list[str]]]:
    """Setting -> flag -> the commands on which that flag sets it (a flag with a default of its own,
    such as demo's --listen, is that command's, not the setting's)."""
    out: dict[str, dict[str, list[str]]] = {}
    for command, parser in _commands():
        for action in parser._actions:
            if action.dest in cli._SETTING_FLAGS and action.default is None and action.option_strings:
                out.setdefault(action.dest, {}).setdefault(_flag(action), []).append(command)
    return out


def _set_commands() -> list[str]:
    return [command for command, parser in _commands() if any(a.dest == "set_values" for a in parser._actions)]


def _type(f: Field) -> str:
    kind = str(f.type).replace(" | None", "")
    return kind + (", may be unset" if "None" in str(f.type) else "")


def _setting(f: Field, flags: dict[str, list[str]]) -> str:
    default = f.default if f.default is not MISSING else None
    where = [f"default {_shown(default)}", f"env {code(ENV_PREFIX + f.name.upper())}"]
    where += [f"flag {flag} ({', '.join(commands)})" for flag, commands in flags.items()]
    limit = MAXIMA.get(f.name)
    text = f.metadata["help"] + "." + (f" At most {_number(limit)}." if limit is not None else "")
    return item(f"{code(f.name)} ({_type(f)}; {'; '.join(where)}):", text)


def _settings_section() -> list[str]:
    flags = _setting_flags()
    every = fields(Settings)
    intro = (f"Each key can be given, lowest precedence first, by its default, the YAML settings file "
             f"(`--config FILE` or `{ENV_PREFIX}CONFIG`), the environment (`{ENV_PREFIX}` and the key in upper "
             f"case), `--set KEY=VALUE` ({', '.join(_set_commands())}) and a dedicated flag where there is one. "
             "A bad value stops start-up with one line that names the key and the fix.")
    return [f"## Agent settings ({len(every)})", "", wrap(intro), ""] + [
        _setting(f, flags.get(f.name, {})) for f in every] + [""]


def _default_of(action: argparse.Action) -> str:
    """The flag's own default, unless its help already says it."""
    if action.default in (None, False, [], argparse.SUPPRESS) or "default" in (action.help or ""):
        return ""
    return f" (default {_shown(action.default)})"


def _flags_section() -> list[str]:
    lines = ["## Commands and their flags", "", wrap(
        "The flags that set an agent setting are listed with it above too; `healthagent COMMAND --help` "
        "prints the same."), ""]
    for command, parser in _commands():
        lines += [f"### healthagent {command}", ""]
        if parser.description:
            lines += [wrap(parser.description), ""]
        for action in parser._actions:
            if action.dest == "help":
                continue
            text = (action.help or "") + _default_of(action)
            lines.append(item(_flag(action) + ":", text))
        if parser.epilog:
            lines += ["", wrap(parser.epilog[0].upper() + parser.epilog[1:] + ".")]
        lines.append("")
    return lines


def _policy_section() -> list[str]:
    largest = ", ".join(f"{kind} {_number(limit)}" for kind, limit in MAX_BY_KIND.items())
    lines = ["## Policy file", "", wrap(
        "The YAML file of `--policy-file` (setting `policy_file`); every section is optional, and an "
        "unknown key, action or value stops start-up with one line that names it. Its sections:"), ""]
    lines += [item(code(name) + ":", text + ".") for name, text in SECTIONS.items()]
    lines += ["", wrap("When each finding opens (the `findings:` section) is listed per code in "
                       "[findings.md](findings.md), column opens."), "",
              "### Thresholds", "", wrap(
                  "The keys of `thresholds:`. A value is " + "; ".join(f"`{k}`: {v}" for k, v in KINDS.items())
                  + f". Largest values by kind: {largest}."), ""]
    for key, threshold in THRESHOLDS.items():
        lines.append(item(f"{code(key)} ({threshold.kind}; default {code(_number(threshold.default))}):",
                          threshold.help + "."))
    return lines + [""]


def render() -> str:
    lines = [first_line(SOURCES), "", "# Settings", "", generated_note(SOURCES), ""]
    lines += _settings_section() + _flags_section() + _policy_section()
    return "\n".join(lines).rstrip("\n") + "\n"
