"""The viewer's Odin panel in a real browser: headless Chromium loads the live viewer of a 2-rank run.

The test checks the panel's elements (the owner toggle, the policy, the phase, per-rank render/wait shares as text
and as a plotly chart, the stale reads) and that they are updated while training goes on, saves a screenshot,
then turns on "Colour by owning rank" in the page and checks the frames the viewer sends after it: every pixel of
the render lies in the plane of the two ranks' colours and the background (a pixel is a blend of the Gaussians
over the background; flat owner colours make every blend such a point), which the scene's own colours do not.
The run ends with a Ctrl+C (a clean stop, exit 130). Chromium comes from the system's packages: the set-up
installs them where they are missing and it may (root with apt-get); elsewhere the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import FAST_TRAINING, TINY_CITY

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BACKGROUND = np.array([0.1490, 0.1647, 0.2157])  # splatfacto's render background (viser's)


def ensure_chromium() -> None:
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
    if subprocess.run(install, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True)
        subprocess.run(install, capture_output=True, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--window-size=1100,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def field(driver, label: str) -> str:
    """The panel's input in the row of the label with this text (its value for a text field)."""
    element = row_input(driver, label)
    return None if element is None else element.get_attribute("value")


def row_input(driver, label: str):
    """The input in the row of a label (viser's rows: the label and its input share an ancestor; the label's
    `for` does not name the input)."""
    return driver.execute_script(
        "const l = Array.from(document.querySelectorAll('label')).find(e => e.textContent === arguments[0]);"
        "for (let e = l; e; e = e.parentElement) { const i = e.querySelector('input'); if (i) return i; }"
        "return null;", label)


# Every wait below is for an event of the system under test (the server answers, the panel's fields fill, the
# training step the panel shows moves on), checked every half second while the training process is alive. Where the
# event follows from training, the bound is in training steps as the panel itself reports them (a loaded 2-core
# machine trains slower, and then the wait is longer in seconds, not in steps); the wall-clock cap only stops a
# test whose run stalled altogether, and says so.
WALL_CAP_S = 600.0


def wait_for(predicate, what: str, alive=None, steps=None, within_steps: int | None = None):
    """Until `predicate()` is truthy (returned). Fails when the run died (`alive()` false), when the training step
    (`steps()`, None while unknown) moved on `within_steps` past its first reading without the event, or after
    the wall-clock cap."""
    deadline, first = time.time() + WALL_CAP_S, None
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None:
            alive()
        step = steps() if steps is not None else None
        if step is not None and within_steps is not None:
            first = step if first is None else first
            assert step - first <= within_steps, f"training went {step - first} steps on without {what}"
        assert time.time() < deadline, f"no {what} after {WALL_CAP_S:.0f} s (the run stalled?)"
        time.sleep(0.5)


def panel_step(driver):
    """The training step the panel's Phase field reports ("phase 3: steps 50-74 (step 60)"), None before."""
    text = field(driver, "Phase") or ""
    return int(text.rsplit("(step ", 1)[1].rstrip(")")) if "(step " in text else None


def on_owner_plane(png: str, palette: np.ndarray, box) -> float:
    """Share of the render's pixels within 0.02 of the plane through the two ranks' colours and the background."""
    from matplotlib.image import imread

    x0, y0, x1, y1 = box
    pixels = imread(png)[y0:y1, x0:x1, :3].reshape(-1, 3)
    normal = np.cross(palette[0] - BACKGROUND, palette[1] - BACKGROUND)
    normal /= np.linalg.norm(normal)
    return float((np.abs((pixels - BACKGROUND) @ normal) < 0.02).mean())


def test_the_odin_panel_shows_the_distribution_live(tmp_path):
    ensure_chromium()
    from selenium.webdriver.common.by import By

    from odin_ns.model import owner_palette

    port = free_port()
    args = [a for a in FAST_TRAINING if a not in ("--vis", "tensorboard")]
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", "2", "odin-throughput", "--output-dir",
           str(tmp_path / "run"), "--vis", "viewer", "--viewer.websocket-host", "127.0.0.1",
           "--viewer.websocket-port", str(port), "--viewer.quit-on-train-completion", "True",
           "--pipeline.viewer-refresh-every", "10", "--max-num-iterations", "100000",
           "--pipeline.model.stop-split-at", "0",
           # the lane on a thread (inline is the default on CPU ranks): the panel shows the update thread's share
           "--pipeline.lane", "thread", *args, *TINY_CITY]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    driver = None
    try:
        def alive():
            assert run.poll() is None, log.read_text()[-3000:]

        def serving():
            alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(serving, "viewer answering")
        driver = browser()
        driver.get(f"http://127.0.0.1:{port}/")
        wait_for(lambda: row_input(driver, "Colour by owning rank") is not None, "Odin panel in the page", alive)
        # the panel fills at every viewer refresh (every 10 steps here)
        # (the refresh before the first step shows an empty window: "over 0 steps")
        wait_for(lambda: (field(driver, "Rank 1") or "").startswith("render")
                 and "over 0 steps" not in field(driver, "Rank 1"), "figures in the panel", alive,
                 lambda: panel_step(driver), within_steps=50)
        for label in ("Policy", "Phase", "Rank 0", "Rank 1", "Ranks", "Stale reads admitted"):
            assert field(driver, label) is not None, label
        assert field(driver, "Policy").startswith("odin-throughput")
        # CPU ranks: no bound on the viewer's copy by default, so it is the whole model
        assert (field(driver, "Gaussians shown") or "").endswith(" (all)"), field(driver, "Gaussians shown")
        assert driver.find_elements(By.XPATH, "//label[text()='Colour by owning rank']")
        assert driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"), "no render/wait chart"
        assert "rank 0" in driver.find_element(By.CSS_SELECTOR, ".js-plotly-plot").text
        shares = field(driver, "Rank 0")
        assert "wait" in shares and "%" in shares
        # throughput-first's owners update beside the render: the update thread's share is shown
        wait_for(lambda: any("on the update thread" in (field(driver, f"Rank {r}") or "") for r in (0, 1)),
                 "update thread's share", alive, lambda: panel_step(driver), within_steps=50)
        step = panel_step(driver)
        wait_for(lambda: (panel_step(driver) or step) > step, "panel update while training", alive)
        assert field(driver, "Stale reads admitted").endswith("blocks")
        odin = driver.find_element(By.XPATH, "//*[text()='Odin']")
        driver.execute_script("arguments[0].scrollIntoView()", odin)
        time.sleep(1)
        driver.save_screenshot(str(tmp_path / "odin_panel.png"))
        assert (tmp_path / "odin_panel.png").stat().st_size > 10_000

        canvas = max((c.rect for c in driver.find_elements(By.TAG_NAME, "canvas")),
                     key=lambda r: r["width"] * r["height"])  # the scene's (three.js), not a chart's
        panel = driver.find_element(By.XPATH, "//*[text()='Connected']").rect
        box = (int(canvas["x"]) + 40, int(canvas["y"]) + 40, int(min(canvas["x"] + canvas["width"], panel["x"])) - 60,
               int(canvas["y"] + canvas["height"]) - 80)
        palette = owner_palette(2).numpy()
        driver.save_screenshot(str(tmp_path / "scene.png"))
        before = on_owner_plane(str(tmp_path / "scene.png"), palette, box)
        toggle = row_input(driver, "Colour by owning rank")
        assert toggle.get_attribute("type") == "checkbox" and not toggle.is_selected()
        driver.execute_script("arguments[0].click()", toggle)

        def coloured():
            driver.save_screenshot(str(tmp_path / "owners.png"))
            return on_owner_plane(str(tmp_path / "owners.png"), palette, box) > 0.97

        # the viewer renders a new frame as training goes on; the owner colours show in one of them
        wait_for(coloured, "render in owner colours", alive, lambda: panel_step(driver), within_steps=100)
        assert before < 0.8, f"the scene's own colours already lie on the owners' plane ({before:.0%})"
    finally:
        if driver is not None:
            driver.quit()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            raise
    assert run.returncode == 130, log.read_text()[-3000:]
