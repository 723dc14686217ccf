"""The built book in a real browser: Debian's Chromium driven by Playwright.

Run after `make book` (make test does): serves _build/html on loopback,
visits every page and fails on console errors, failed requests, broken
internal links, images that did not load and math left as raw TeX; steps
through every frame of every step-through and checks that each frame is a
new image with its numbers listed as text. A screenshot of
each page is kept in _build/screenshots/.
"""

import functools
import http.server
import re
import threading
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# Pages of the book (index.html only redirects to intro.html).
PAGES = sorted(str(p.relative_to(SITE)) for p in SITE.rglob("*.html")
               if p.name != "index.html" and "_static" not in p.parts
               and "mathjax" not in p.parts)


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").is_file():
        pytest.fail("no built book in _build/html: run `make book` first")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(SITE))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


def open_page(browser, url, problems):
    """A page at url, with console errors and failed requests recorded."""
    page = browser.new_page(viewport={"width": 1200, "height": 1400})
    page.on("console", lambda m: problems.append(f"console: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(
        f"request failed: {r.url}"))
    page.on("response", lambda r: problems.append(
        f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(url, wait_until="load")
    # MathJax loads deferred: wait until it has started, then until it
    # has typeset the page
    page.wait_for_function("""() => !document.querySelector(".math")
        || (window.MathJax && MathJax.startup && MathJax.startup.promise)""",
                           timeout=20000)
    page.evaluate("""() => window.MathJax && MathJax.startup
        ? MathJax.startup.promise.then(() => true) : true""")
    return page


def test_there_are_pages():
    assert "book/intro.html" in PAGES and len(PAGES) >= 12


@pytest.mark.parametrize("name", PAGES)
def test_page_renders_completely(server, browser, name):
    problems = []
    url = urljoin(server, name)
    page = open_page(browser, url, problems)
    broken = page.evaluate("""() => [...document.images]
        .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)""")
    problems += [f"image not loaded: {src}" for src in broken]
    for href in page.eval_on_selector_all(
            "a[href]", "els => els.map(e => e.getAttribute('href'))"):
        target = urlparse(urljoin(url, href))
        if target.netloc != urlparse(server).netloc or not target.path:
            continue  # external or javascript: links are not ours to test
        path = SITE / unquote(target.path).lstrip("/")
        if path.is_dir():
            path = path / "index.html"
        if not path.exists():
            problems.append(f"broken link: {href}")
    html = page.content()
    text = page.evaluate("""() => {  // the prose: code may hold \\( itself
        const body = document.body.cloneNode(true);
        body.querySelectorAll("pre, code, script").forEach(e => e.remove());
        return body.innerText; }""")
    if "\\(" in text or "\\[" in text or "$$" in text:
        problems.append("raw TeX visible: math was not typeset")
    if "math notranslate" in html and "<mjx-container" not in html:
        problems.append("page has math but MathJax typeset none of it")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / (name.replace("/", "_") + ".png")))
    page.close()
    assert not problems, "\n".join(problems)


# Pages with a step-through (matplotlib's player, frames inline).
PLAYERS = [p for p in PAGES
           if "_anim_img" in (SITE / p).read_text(encoding="utf-8")]


def test_there_are_step_throughs():
    assert len(PLAYERS) >= 4


@pytest.mark.parametrize("name", PLAYERS)
def test_step_through_frames_differ_and_carry_numbers(server, browser,
                                                      name):
    """Next walks every frame of every player: each frame is a new image,
    and the frames' text under the player has numbers for each one."""
    problems = []
    page = open_page(browser, urljoin(server, name), problems)
    ids = [i[len("_anim_img"):] for i in page.eval_on_selector_all(
        "img[id^='_anim_img']", "els => els.map(e => e.id)")]
    assert ids
    for uid in ids:
        frames = int(page.get_attribute(f"#_anim_slider{uid}", "max")) + 1
        texts = page.evaluate("""uid => {
            let e = document.getElementById("_anim_img" + uid);
            while (e && !e.querySelector("details.frame-text"))
                e = e.parentElement;
            return e ? [...e.querySelectorAll("details.frame-text li")]
                .map(li => li.textContent) : []; }""", uid)
        assert len(texts) == frames >= 2, f"{name}: frame text missing"
        assert all(re.search(r"\d", t) for t in texts), texts
        seen = [page.get_attribute(f"#_anim_img{uid}", "src")]
        for _ in range(frames - 1):
            page.click(f"button[onclick='anim{uid}.next_frame()']")
            seen.append(page.get_attribute(f"#_anim_img{uid}", "src"))
        assert all(seen) and len(set(seen)) == frames, (
            f"{name}: Next did not show {frames} different frames")
    page.close()
    assert not problems, "\n".join(problems)


def test_explorer_lanes_reach_the_same_output(server, browser):
    """Chapter 5's explorer: pick a query, step to the end of both lanes."""
    problems = []
    page = open_page(browser, urljoin(server, "notebooks/05_tiling.html"),
                     problems)
    root = page.locator("div.flashlab-explorer").first
    select = root.locator("select")
    assert select.locator("option").count() == 6
    for query in ("0", "3"):
        select.select_option(query)
        seen = set()
        for _ in range(10):  # more clicks than steps: Next stops at the end
            seen.add(root.locator("pre").first.inner_text())
            root.locator("button[title='Next step']").click()
        end = root.locator("p").last.inner_text()
        assert "same output" in end and len(seen) >= 3, (query, seen)
        assert float(end.rsplit("= ", 1)[1]) < 1e-12
    page.close()
    assert not problems, "\n".join(problems)
