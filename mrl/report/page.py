"""The report's HTML: page.html with page.css, page.js and the run's data inlined, so the one file
opens anywhere, offline. The data travels as JSON in a <script type="application/json"> block."""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any


def render_page(data: dict[str, Any]) -> str:
    assets = resources.files("mrl.report")
    template = assets.joinpath("page.html").read_text(encoding="utf-8")
    parts = {
        "TITLE": html.escape(f"mrl report: {data['run']}"),
        "CSS": assets.joinpath("page.css").read_text(encoding="utf-8"),
        "JS": assets.joinpath("page.js").read_text(encoding="utf-8"),
        "DATA": embedded_json(data),
    }
    for name, text in parts.items():
        template = template.replace(f"@@{name}@@", text)
    return template


def embedded_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: every '<' escaped, so no '</script>' or '<!--'
    in a prompt or response can end the block early (JSON.parse reads \\u003c back as '<')."""
    return json.dumps(data, allow_nan=False, ensure_ascii=False).replace("<", "\\u003c")
