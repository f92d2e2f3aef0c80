"""The page's files (issue 17) as the browser gets them: only local files, nothing inline
that the Content-Security-Policy would block, no way for API text to become markup, and the
DOM contract the browser test reads present in the HTML."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agent.apis.page import UI_DIR

UI = UI_DIR  # the folder the local API serves the page from
SCRIPTS = sorted(UI.glob("*.js"))


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []  # text inside <script> or <style>
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag if tag in ("script", "style") else None

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open and data.strip():
            self.inline.append(data)


def _page() -> _Page:
    page = _Page()
    page.feed((UI / "index.html").read_text())
    return page


def _local(url: str) -> bool:
    return not re.match(r"^([a-z][a-z0-9+.-]*:|//)", url, re.I) or url.startswith("data:")


def test_the_html_loads_only_local_files_and_holds_nothing_inline() -> None:
    page = _page()
    assert page.inline == []
    for tag, attrs in page.tags:
        assert tag != "style"
        assert "style" not in attrs, f"<{tag} style> is inline style (CSP style-src 'self')"
        assert not [a for a in attrs if a.startswith("on")], f"<{tag}> has an inline handler"
        for name in ("src", "href", "action"):
            url = attrs.get(name)
            if url is not None:
                assert _local(url), f"<{tag} {name}={url!r}> leaves the agent"
    scripts = [attrs for tag, attrs in page.tags if tag == "script"]
    assert scripts == [{"type": "module", "src": "app.js"}]


def test_every_module_imported_is_a_file_of_the_page_and_every_file_is_used() -> None:
    imported = {"app.js"}
    for script in SCRIPTS:
        for name in re.findall(r"""^import .* from '(.+)';$""", script.read_text(), re.M):
            assert name.startswith("./"), (script.name, name)
            assert (UI / name[2:]).is_file(), (script.name, name)
            imported.add(name[2:])
    assert imported == {s.name for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_api_text_never_becomes_markup_or_code(script: Path) -> None:
    source = script.read_text()
    for banned in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "setAttribute('style'",
        "javascript:",
    ):
        assert banned not in source, f"{script.name} uses {banned}"
    # Requests go to the page's own origin only: paths, never a scheme and host.
    urls = re.findall(r"""['"`](\w+://[^'"`]*)""", source)
    assert urls in ([], ["http://www.w3.org/2000/svg"]), urls
    # No prompt or completion text is read: the page shows counts, never a body's text.
    assert not re.search(r"\.(messages|choices|prompt|completion|content)\b", source)


def test_the_css_loads_nothing_from_elsewhere() -> None:
    css = (UI / "app.css").read_text()
    assert "@import" not in css
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", css)
    assert "prefers-color-scheme: dark" in css


def test_the_dom_contract_is_in_the_html() -> None:
    page = _page()
    ids = {attrs.get("id") for _, attrs in page.tags}
    views = ("jobs", "nodes", "deployments", "usage", "cluster")
    assert {a["data-view"] for t, a in page.tags if t == "button" and "data-view" in a} == set(
        views
    )
    assert {f"view-{v}" for v in views} <= ids
    assert {"conn", "jobs", "job-counts", "more", "filter-state", "filter-model"} <= ids
    assert {"filter-node", "filter-requester"} <= ids
    counted = {a["data-state"] for t, a in page.tags if t == "button" and "data-state" in a}
    assert counted == {"queued", "running", "completed", "failed", "cancelled"}
    charts = {a["data-series"] for t, a in page.tags if t == "svg" and a.get("class") == "chart"}
    assert charts == {"requests", "tokens", "ttft", "latency"}
