"""The documentation site (docs/, Sphinx + MyST) and the README: the site builds with warnings as
errors, every Python sample of its pages and of the README runs, the docstrings' examples pass
as doctests, the API page documents every public name, and the README stays the front door
(at most README_MAX_LINES lines).

Samples are the fenced ```python blocks of a page, run in order in one fresh interpreter per
page on the CPU backend (later blocks see what earlier ones defined, as a reader does). A block that cannot run
here says so on the line just before its fence, with the reason:

    <!-- docs-test: skip (needs a CUDA GPU) -->

and a page whose samples need several devices asks for host devices once, on a line of its own:

    <!-- docs-test: devices=8 -->

(the page then runs with XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *DOCS.glob("*.md")])
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
DEVICES = re.compile(r"^<!--\s*docs-test:\s*devices=(?P<n>\d+)\s*-->\s*$", re.M)


def samples(text: str) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of a Markdown text, in order, but those marked
    skip (with a reason) on the line before their fence."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,})(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[j]):
            j += 1
        skipped = i > 0 and SKIP.search(lines[i - 1])
        if lang == "python" and not skipped:
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]]
            out.append((i + 2, "\n".join(body)))
        i = j + 1
    return out


def test_samples_finds_blocks_and_skips_marked_ones():
    text = textwrap.dedent(
        """\
        ```python
        a = 1
        ```
        <!-- docs-test: skip (needs a CUDA GPU) -->
        ```python
        gpu()
        ```
        ```bash
        ls
        ```
        - item:

          ```python
          b = a
          ```
        """
    )
    assert samples(text) == [(2, "a = 1"), (14, "b = a")]


# Each page's samples in a fresh interpreter: the namespace carries over from block to block,
# and a failing block names its page and line.
RUNNER = """
import sys, traceback
blocks = {blocks!r}
ns = {{"__name__": "__docs_sample__"}}
for line, code in blocks:
    try:
        exec(compile(code, "{page}:" + str(line), "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print("FAILED: the sample at {page}:" + str(line), file=sys.stderr)
        sys.exit(1)
print("ran", len(blocks), "samples")
"""


def reader_env() -> dict[str, str]:
    """The environment of a reader who runs a sample: this one without the suite's own settings
    (JAX_FLASH_* variables such as the CUDA emulation, float64 by default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_FLASH_") and k != "JAX_ENABLE_X64"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def run_samples(page: str, text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # On the CPU backend wherever the suite runs: the pages show CPU output, and a page's
    # host devices (devices=N) are CPU devices. The GPU suite covers the GPU paths.
    env = dict(reader_env(), JAX_PLATFORMS="cpu")
    devices = DEVICES.search(text)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices['n']} " + env.get("XLA_FLAGS", "")
    script = RUNNER.format(blocks=samples(text), page=page)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("page", PAGES)
def test_page_samples_run(page, tmp_path):
    text = (ROOT / page).read_text()
    result = run_samples(page, text, tmp_path)
    assert result.returncode == 0, f"{page}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def test_a_broken_sample_fails(tmp_path):
    """The runner reports a sample that raises, with its page and line."""
    text = "```python\nimport jax_flash\n```\n\ntext\n\n```python\njax_flash.no_such_function()\n```\n"
    result = run_samples("broken.md", text, tmp_path)
    assert result.returncode == 1 and "FAILED: the sample at broken.md:8" in result.stderr, result.stderr


def sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html", str(source), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_site_builds_without_warnings(tmp_path):
    result = sphinx_build(DOCS, tmp_path / "html")
    assert result.returncode == 0, result.stderr[-6000:]
    for page in ("index", "api", "benchmarks", "getting-started"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("jax_flash.attention", "jax_flash.ring_attention", "jax_flash.flax.attention_fn"):
        assert f'id="{name}"' in api, name


def test_a_warning_fails_the_build(tmp_path):
    """The same configuration with one broken cross-reference: the build fails."""
    source = tmp_path / "docs"
    source.mkdir()
    (source / "conf.py").write_text((DOCS / "conf.py").read_text().replace('os.path.abspath("..")', repr(str(ROOT))))
    (source / "index.md").write_text("# Page\n\nSee [nowhere](missing.md).\n")
    result = sphinx_build(source, tmp_path / "html")
    assert result.returncode != 0 and "missing.md" in result.stderr, result.stderr


def public_objects() -> dict[str, object]:
    import jax_flash
    import jax_flash.flax

    objects = {f"jax_flash.{name}": getattr(jax_flash, name) for name in jax_flash.__all__ if name != "__version__"}
    objects.update({f"jax_flash.flax.{name}": getattr(jax_flash.flax, name) for name in jax_flash.flax.__all__})
    objects["jax_flash.flax"] = jax_flash.flax
    try:
        import jax_flash.haiku
    except ImportError as e:  # haiku is in [test]; without it its page cannot be built either
        pytest.fail(f"jax_flash.haiku cannot be imported: {e}")
    objects["jax_flash.haiku.MultiHeadAttention"] = jax_flash.haiku.MultiHeadAttention
    return objects


def test_docstring_examples():
    """The `>>>` examples of every public docstring run and print what they show."""
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    examples = 0
    for name, obj in public_objects().items():
        for test in finder.find(obj, name, globs={"jax_flash": importlib.import_module("jax_flash")}):
            examples += len(test.examples)
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed (output above)"
    assert examples >= 10, f"only {examples} docstring examples found"


def test_api_page_documents_every_public_name():
    import jax_flash

    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class|data|module):: (\S+)", text, re.M))
    missing = [name for name in jax_flash.__all__ if f"jax_flash.{name}" not in documented]
    assert not missing, f"docs/api.md lacks {missing}"
    assert {"jax_flash.flax.attention_fn", "jax_flash.flax.make_attention_fn"} <= documented
    assert "jax_flash.haiku.MultiHeadAttention" in documented


def test_readme_is_short_and_links_into_the_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_shown_explain_output_is_what_the_example_prints(page, tmp_path):
    """The example output of the README and the landing page is what their example prints
    (on a CPU backend; run in a fresh interpreter, as a reader would, not under the suite's
    float64 setting)."""
    text = (ROOT / page).read_text()
    shown = re.search(r"```text\n(jax_flash\.attention would run:.*?)\n```", text, re.S)
    assert shown, f"{page} shows no explain output"
    example = next(c for _, c in samples(text) if "jax_flash.explain(" in c)
    env = dict(reader_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == shown.group(1), result.stdout


def test_benchmark_plots_come_from_the_recorded_table(tmp_path):
    """docs/plot_benchmarks.py reads every row of the recorded table on docs/benchmarks.md and
    draws its plots with the bench's --plot; the committed images are the ones it writes."""
    sys.path.insert(0, str(DOCS))
    try:
        import plot_benchmarks
    finally:
        sys.path.remove(str(DOCS))
    results = plot_benchmarks.recorded()
    # 2 dtypes x 2 head dims x 3 lengths x 2 causal x 2 passes cells, each with cpu and torch,
    # and jax.nn where it ran (1k and 4k).
    assert sum(r.impl == "cpu" for r in results) == 48
    assert sum(r.impl == "torch" for r in results) == 48
    assert sum(r.impl == "jax.nn" for r in results) == 32
    paths = plot_benchmarks.main(tmp_path)
    for path in paths:
        assert path.stat().st_size > 10_000, path
        assert (DOCS / "_static" / path.name).is_file(), f"{path.name} is not committed under docs/_static"
        assert f"_static/{path.name}" in (DOCS / "benchmarks.md").read_text()


def test_test_extra_installs_the_docs_extra():
    """The suite builds the site: `pip install ".[test]"` brings what `.[docs]` does."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["docs"] and set(extras["docs"]) <= set(extras["test"]), (extras["docs"], extras["test"])
