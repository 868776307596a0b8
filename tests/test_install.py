"""What a fresh install offers: the version written once, the command line as a module,
typed metadata, a clear message from the source tree, and a warning when both ORT
distributions share the one 'onnxruntime' folder."""
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import onnx_offload
from onnx_offload.install import conflict, installed_versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_version_is_written_once_and_the_cli_says_it(tmp_path):
    assert onnx_offload.__version__ == importlib.metadata.version("onnx-offload")
    for argv in (["onnx-offload", "--version"], [sys.executable, "-m", "onnx_offload", "--version"]):
        r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"onnx-offload {onnx_offload.__version__} (onnxruntime "), r.stdout


def test_metadata_license_classifiers_and_types():
    meta = importlib.metadata.metadata("onnx-offload")
    assert "License :: OSI Approved :: MIT License" in meta.get_all("Classifier")
    assert "Typing :: Typed" in meta.get_all("Classifier")
    requires = " ".join(meta.get_all("Requires-Dist"))
    assert "onnxruntime-gpu<1.33,>=1.31" in requires and "ml_dtypes" in requires
    assert os.path.exists(os.path.join(os.path.dirname(onnx_offload.__file__), "py.typed"))
    assert os.path.exists(os.path.join(ROOT, "LICENSE"))


def test_importing_the_source_tree_says_what_to_do():
    r = subprocess.run([sys.executable, "-c", "import onnx_offload"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert "ModuleNotFoundError" in r.stderr and "pip install ." in r.stderr and "source tree" in r.stderr, r.stderr


def _site(root, *dists):
    """A site folder holding the given (distribution, version) installs' metadata."""
    os.makedirs(root, exist_ok=True)
    for name, version in dists:
        info = os.path.join(root, f"{name.replace('-', '_')}-{version}.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return [importlib.metadata.PathDistribution(pathlib.Path(root, e)) for e in sorted(os.listdir(root))]


def test_both_ort_distributions_installed_is_named_with_the_fix(tmp_path):
    site = str(tmp_path / "site")
    dists = _site(site, ("onnxruntime", "1.32.0"), ("onnxruntime-gpu", "1.31.1"))
    loaded = os.path.join(site, "onnxruntime", "__init__.py")
    found = installed_versions(loaded, dists)
    assert found == {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}
    why = conflict(found, "1.32.0 with CPUExecutionProvider")
    assert "onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1" in why
    assert "pip uninstall onnxruntime'" in why and "pip uninstall onnxruntime-gpu'" in why
    assert conflict(installed_versions(loaded, dists[1:]), "1.31.1") is None


def test_an_ort_in_another_site_folder_is_shadowed_not_a_conflict(tmp_path):
    # A system onnxruntime under the onnxruntime-gpu that a virtual environment (or
    # PYTHONPATH) puts first: the imported folder is the GPU one's alone.
    system = _site(str(tmp_path / "system"), ("onnxruntime", "1.30.0"))
    venv = _site(str(tmp_path / "venv"), ("onnxruntime-gpu", "1.31.1"))
    loaded = str(tmp_path / "venv" / "onnxruntime" / "__init__.py")
    assert installed_versions(loaded, venv + system) == {"onnxruntime-gpu": "1.31.1"}
    assert conflict(installed_versions(loaded, venv + system), "1.31.1") is None


def test_the_installed_ort_is_found_from_its_own_folder():
    import onnxruntime
    found = installed_versions(onnxruntime.__file__)
    assert found and set(found) <= {"onnxruntime", "onnxruntime-gpu"}
    assert onnxruntime.__version__ in found.values()


def test_every_image_the_docs_show_is_in_the_repository():
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pages = [pathlib.Path(root, "README.md")] + sorted(pathlib.Path(root, "docs").glob("*.md"))
    images = [(page, image) for page in pages for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())]
    assert images
    for page, image in images:
        assert os.path.isfile(os.path.join(page.parent, image)), (page, image)


def test_without_onnxruntime_the_import_names_the_extras(tmp_path):
    code = ("import sys\nsys.modules['onnxruntime'] = None  # as where neither distribution is installed\n"
            "try:\n    import onnx_offload\nexcept ModuleNotFoundError as e:\n    print(e.name, e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("onnxruntime ") and "onnx-offload[gpu]" in run.stdout and \
        "onnx-offload[cpu]" in run.stdout, run.stdout
