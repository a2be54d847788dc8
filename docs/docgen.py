"""Generate the reference parts of ``docs/`` from the code: ``python docs/docgen.py``.

Writes ``docs/schemas/*.json`` (JSON Schema of the models in ``schemas/``) and the
generated sections of ``docs/configuration.md`` (one row per ``Settings`` field). A
generated section sits between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED: name -->``; the prose around it is written by hand.
``--check`` writes nothing and exits 1 when a file is out of date (tests/test_docs.py
runs the same comparison).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from schemas.events import DATA_MODELS, StreamEvent
from schemas.jobs import JobRecord
from schemas.requests import ChatRequest, JobSpec
from worker.settings import Settings, Upstream

ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "CHATSTREAM_"

SCHEMA_MODELS: dict[str, type[BaseModel]] = {
    "job-record.json": JobRecord,
    "job-spec.json": JobSpec,
    "chat-request.json": ChatRequest,
}
DRAFT = "https://json-schema.org/draft/2020-12/schema"


# -- JSON Schema --------------------------------------------------------------------------


def dump_schema(schema: dict[str, Any]) -> str:
    return json.dumps({"$schema": DRAFT, **schema}, indent=2, ensure_ascii=False) + "\n"


def stream_event_schema() -> dict[str, Any]:
    """``StreamEvent`` with ``data`` constrained per ``type`` to its ``DATA_MODELS`` model."""
    schema = StreamEvent.model_json_schema()
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    rules: list[dict[str, Any]] = []
    for event_type, model in DATA_MODELS.items():
        sub = model.model_json_schema()
        defs.update(sub.pop("$defs", {}))
        defs[model.__name__] = sub
        rules.append(
            {
                "if": {"properties": {"type": {"const": event_type.value}}},
                "then": {"properties": {"data": {"$ref": f"#/$defs/{model.__name__}"}}},
            }
        )
    schema["$defs"] = dict(sorted(defs.items()))
    schema["allOf"] = rules
    return schema


def schema_files() -> dict[str, str]:
    """File name under docs/schemas/ -> its content."""
    files = {"stream-event.json": dump_schema(stream_event_schema())}
    for name, model in SCHEMA_MODELS.items():
        files[name] = dump_schema(model.model_json_schema())
    return files


# -- configuration reference ----------------------------------------------------------------


def type_name(annotation: Any) -> str:
    """A reader's name for a field type: ``integer``, ``secret string``, ``text | json``."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{value}`" for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        names = [type_name(arg) for arg in get_args(annotation) if arg is not type(None)]
        return " \\| ".join(names)
    if origin is dict:
        value = get_args(annotation)[1]
        inner = "upstream" if value is Upstream else type_name(value)
        return f"JSON object (name → {inner})"
    simple: dict[Any, str] = {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        SecretStr: "secret string",
    }
    return simple.get(annotation, getattr(annotation, "__name__", str(annotation)))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def constraints_text(field: FieldInfo) -> str:
    parts: list[str] = []
    for item in field.metadata:
        for name, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            bound = getattr(item, name, None)
            if bound is not None:
                parts.append(f"{symbol} {bound}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    rows = [
        "| variable | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        description = _cell(field.description or "")
        constraints = constraints_text(field)
        if constraints:
            description += f" ({_cell(constraints)})"
        rows.append(
            f"| `{ENV_PREFIX}{name.upper()}` | {type_name(field.annotation)} "
            f"| {default_text(field)} | {description} |"
        )
    return "\n".join(rows)


def upstream_table() -> str:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in Upstream.model_fields.items():
        rows.append(
            f"| `{name}` | {type_name(field.annotation)} | {default_text(field)} "
            f"| {_cell(field.description or '')} |"
        )
    return "\n".join(rows)


GENERATED = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z-]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


def fill_generated(text: str, sections: dict[str, str]) -> str:
    """``text`` with every generated section replaced by its current content."""
    missing = set(sections) - {m.group("name") for m in GENERATED.finditer(text)}
    if missing:
        raise ValueError(f"no generated section for {sorted(missing)}")

    def replace(match: re.Match[str]) -> str:
        return match.group(1) + sections[match.group("name")] + "\n" + match.group(3)

    return GENERATED.sub(replace, text)


# -- all outputs --------------------------------------------------------------------------


def outputs(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file and the content it must have."""
    files = {root / "docs" / "schemas" / name: text for name, text in schema_files().items()}
    config = root / "docs" / "configuration.md"
    sections = {"settings": settings_table(), "upstream": upstream_table()}
    files[config] = fill_generated(config.read_text(encoding="utf-8"), sections)
    return files


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files whose content is not current."""
    return [
        path
        for path, content in outputs(root).items()
        if not path.exists() or path.read_text(encoding="utf-8") != content
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/docgen.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale(args.root)
        for path in out_of_date:
            print(f"stale: {path.relative_to(args.root)}", file=sys.stderr)
        return 1 if out_of_date else 0
    for path, content in outputs(args.root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            path.write_text(content, encoding="utf-8")
            print(f"wrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
