"""attnviz in a real Jupyter kernel (nbclient): a heatmap result displays the interactive view
inline, as an iframe holding the whole offline page, and a PNG for front ends without HTML."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT, LazyModule, lazy_import

nbformat = lazy_import("nbformat", "nbclient", "ipykernel")  # imported when a test runs
nbclient = LazyModule("nbclient")

CELLS = [
    "import attnviz",
    "heat = attnviz.run_heatmap(['the cat sat on the mat the cat sat'])\nheat",
    "attnviz.split(embed_dim=16, num_heads=4)",
]


@pytest.mark.slow
def test_notebook_displays_the_interactive_view(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.kernel_manager_class = "jupyter_client.manager.KernelManager"
    client.km = client.create_kernel_manager()
    client.km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f",
                            "{connection_file}"]
    client.execute()
    heatmap_output = notebook.cells[1].outputs[0]["data"]
    html = heatmap_output["text/html"]
    assert html.startswith("<iframe") and "srcdoc=" in html and "https://" not in html
    assert "image/png" in heatmap_output
    split_output = notebook.cells[2].outputs[0]["data"]
    assert "image/png" in split_output
    errors = [o for cell in notebook.cells for o in cell.outputs if o["output_type"] == "error"]
    assert errors == []
