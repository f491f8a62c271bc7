"""The report as a reader sees it: rendered by headless Chromium in a 1,400-pixel-wide window,
the page does not scroll sideways, no table, figure or code block reaches past the window, and
every figure loaded. Needs Chromium, its driver and selenium (Debian: ``apt-get install
chromium chromium-driver``; ``pip install selenium``); skipped where they are missing, as in CI."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from modbench.report.build import write_report
from tests.report.test_report import fake_results

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no headless Chromium here (apt-get install chromium chromium-driver)")

MEASURE = """
const vw = window.innerWidth;
const past = [...document.querySelectorAll('table, img, pre, figure, p, ul, h1, h2, h3')]
  .filter(e => e.getBoundingClientRect().right > vw + 1)
  .map(e => e.tagName + ': ' + e.textContent.slice(0, 40));
return {inner: vw, scroll: document.documentElement.scrollWidth, past: past,
        images: [...document.images].map(i => [i.complete, i.naturalWidth,
                                                 i.getBoundingClientRect().width])};
"""


def _render(page: Path, width: int, profile: Path) -> dict[str, Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    # this machine's network is closed: no background connections, a fresh profile
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={profile}",
                f"--window-size={width},900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(str(DRIVER)))
    try:
        driver.get(page.as_uri())
        return dict(driver.execute_script(MEASURE))
    finally:
        driver.quit()


def test_report_fits_a_1400_pixel_window(tmp_path: Path) -> None:
    methods = {"baseline": 3, "post_ln+comt": 3, "ln_scaling": 3, "mix_ln": 3, "deepnorm": 2,
               "layerscale(init=1e-4)": 3, "post_ln": 1}
    res = fake_results(tmp_path, methods)
    page = write_report(res, tmp_path / "report") / "report.html"
    got = _render(page, 1400, tmp_path / "chromium")
    assert got["inner"] == 1400
    assert got["scroll"] <= got["inner"], got  # no sideways scrolling
    assert got["past"] == []
    assert got["images"], "the report has figures"
    for complete, natural, shown in got["images"]:
        assert complete and natural > 0  # loaded
        assert 0 < shown <= 1400


def test_the_check_sees_a_page_wider_than_the_window(tmp_path: Path) -> None:
    """The measurement itself: a table wider than the window is reported."""
    page = tmp_path / "wide.html"
    cells = "".join(f"<td>column-{i}-with-a-long-unbreakable-name</td>" for i in range(40))
    page.write_text(f"<html><body><table><tr>{cells}</tr></table></body></html>")
    got = _render(page, 1400, tmp_path / "chromium")
    assert got["scroll"] > 1400 and any(p.startswith("TABLE") for p in got["past"])
