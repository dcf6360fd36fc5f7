"""The demo notebook, executed end to end in a real Jupyter kernel (nbclient + ipykernel), and the
values in its outputs: what the tracker, the decorators, the magics, the reporter and Courtesy
print on CPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

import memlab

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "memlab_demo.ipynb"


def kernel_for_this_interpreter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data directory holding a ``python3`` kernelspec that runs ``sys.executable``."""
    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "kernels" / "python3")
    return root


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """``{tag: {"stdout": ..., "text/plain": ..., "text/html": ...}}`` of the executed notebook.

    The kernel is a ``python3`` kernelspec written for this interpreter (``sys.executable``) into
    a directory put first on ``JUPYTER_PATH``, so the kernel imports the memlab under test
    whatever kernelspecs the machine has.
    """
    root = kernel_for_this_interpreter(tmp_path_factory)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(root))
        client = NotebookClient(
            notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(root)}}
        )
        client.execute()
    found: dict[str, dict[str, str]] = {}
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        texts: dict[str, str] = {"stdout": "", "text/plain": "", "text/html": "", "image/png": ""}
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stdout":
                texts["stdout"] += output.text
            elif output.output_type in ("execute_result", "display_data"):
                for kind in ("text/plain", "text/html", "image/png"):
                    texts[kind] += output.data.get(kind, "")
        for tag in cell.metadata.get("tags", []):
            found[tag] = texts
    return found


def rows(text: str) -> dict[str, list[list[str]]]:
    """``{function: [[*values, line, code words...], ...]}`` of the printed line tables; each
    heading ``## function  (cell file:line)`` names the kernel's file of the cell and the def line."""
    tables: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            name, _, where = line[3:].partition("  (")
            assert re.fullmatch(r".+:\d+\)", where), line
            current = tables.setdefault(name, [])
        elif len(line.split()) > 3 and any(part.isdigit() for part in line.split()[:3]):
            current.append(line.split())
    return tables


def test_committed_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert notebook.metadata.kernelspec.name == "python3"


def test_kernel_runs_the_memlab_under_test(
    outputs: dict[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any
) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_for_this_interpreter(tmp_path_factory)))
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    assert outputs["setup"]["stdout"].startswith(f"memlab {memlab.__version__} | torch ")


def test_tracker_reports_what_a_gpu_would(outputs: dict[str, dict[str, str]]) -> None:
    assert outputs["tracker"]["stdout"].split("\n")[:2] == [
        "active_bytes.all.peak   40960",
        "reserved_bytes.all.peak 2097152",
    ]
    assert outputs["meta"]["stdout"] == "estimated reserved MiB: 258\n"


def test_profile_decorator_table(outputs: dict[str, dict[str, str]]) -> None:
    text = outputs["profile"]["text/plain"]
    # layer (40 448 B + 512 B) from section 1 is alive: adopted when profiling starts, as on a GPU
    assert text.splitlines()[0] == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); 2 tensor storages (40.00K) existed before profiling"
    )
    tables = rows(text)
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert [re.sub(r"\(.*:", "(CELL:", line) for line in headings] == [
        "## inner  (CELL:2)",
        "## outer  (CELL:7)",
    ]
    assert [row[:3] for row in tables["outer"]] == [
        ["40.00K", "2.00M", "7"],
        ["80.00K", "2.00M", "8"],
        ["120.00K", "2.00M", "9"],
        ["160.00K", "2.00M", "10"],
    ]
    assert [row[:3] for row in tables["inner"]] == [["120.00K", "2.00M", "2"], ["160.00K", "2.00M", "3"]]


def test_mlrun_cell_renders_html_with_the_sizes(outputs: dict[str, dict[str, str]]) -> None:
    cell = outputs["mlrun-cell"]
    assert rows(cell["text/plain"])["work"] == [
        ["40.00K", "2.00M", "1", "def", "work():"],
        ["4.04M", "22.00M", "2", "a", "=", "torch.empty(1024,", "1024)"],
        ["8.04M", "22.00M", "3", "b", "=", "torch.empty(1024,", "1024)"],
        ["12.04M", "22.00M", "4", "return", "a", "+", "b"],
    ]
    html = cell["text/html"]
    assert "<table" in html and all(
        f">{size}</td>" in html for size in ("4.04M", "8.04M", "12.04M", "22.00M")
    )
    assert html.startswith("<p>modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu ")


def test_mlrun_line_with_columns(outputs: dict[str, dict[str, str]]) -> None:
    work = rows(outputs["mlrun-line"]["text/plain"])["work"]
    assert [row[:3] for row in work] == [
        ["40.00K", "1", "1"],
        ["4.04M", "1", "2"],
        ["8.04M", "1", "3"],
        ["12.04M", "1", "4"],
    ]
    assert "reserved" not in outputs["mlrun-line"]["text/plain"]


def test_memreport_names_every_tensor_of_the_model(outputs: dict[str, dict[str, str]]) -> None:
    lines = [line.split() for line in outputs["memreport"]["stdout"].splitlines()]
    for expected in (
        ["weight", "(1024,", "1024)", "4.00M"],
        ["weight.grad", "(1024,", "1024)", "4.00M"],
        ["bias", "(1024,)", "4.00K"],
        ["AdamW.weight.exp_avg", "(1024,", "1024)", "4.00M"],
        ["AdamW.bias.exp_avg_sq", "(1024,)", "4.00K"],
    ):
        assert expected in lines


def test_courtesy_parks_and_restores(outputs: dict[str, Any]) -> None:
    assert outputs["courtesy"]["stdout"] == "before 4198400 | parked 0 | after 4198400 | same weights: True\n"


def test_the_memory_plot_shows_inline(outputs: dict[str, Any]) -> None:
    # weights and gradients: twice 512x1024 + 1024 + 1024x10 + 10 floats, each in 512 B blocks; the
    # modelled H100's cuBLAS workspaces of the forward's thread and the autograd thread, 32 MiB each
    assert outputs["plot"]["stdout"] == (
        f"allocated now: {4285440 + 2 * 32 * 2**20} B (weights, gradients, two cuBLAS workspaces)\n"
    )
    assert outputs["plot"]["image/png"].startswith("iVBORw0KGgo")  # a base64 PNG


def test_the_estimate_cell_prints_the_peak_and_the_batch_that_fits(outputs: dict[str, Any]) -> None:
    assert outputs["estimate"]["stdout"] == (
        "peak reserved: 245366784 B; fits in 1 GiB: True\n"  # 178257920 B and two 32 MiB workspaces
        "largest batch that fits in 1.00G for 2 steps in a row: 12160 (peak reserved 1018.00M); 12161 needs "
        "1.10G; 29 estimates; includes 2 modelled cuBLAS workspaces of the H100: 64.00M\n"
    )
    assert "<b>234.00M</b>" in outputs["estimate"]["text/html"]  # the Estimate's HTML: its peak reserved
