"""``orchestrator remote install PROFILE``: this laptop's orchestrator, pushed to the login host.

Login hosts often have no internet, so nothing is downloaded there. The laptop sends, in one SSH
call, a tar of its own ``orchestrator`` package (the code this laptop runs: same version by
construction) with its data (``job_templates``, ``cluster_profiles``: beside the package in an
editable install, inside it in the tar) and, with ``--wheels DIR``, the wheels in DIR. A small bootstrap run by the login
host's ``python3`` creates the venv ``login.python`` names (``--system-site-packages``: the host's
own packages count), replaces the package in it, installs the wheels with ``pip --no-index``, and
reports which of the dependencies still do not import. Those are named with the two commands that
fix them (``pip download`` on the laptop, then ``--wheels``): never a surprise install.
"""

from __future__ import annotations

import io
import json
import shlex
import tarfile
from importlib import metadata
from pathlib import Path

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.remote.calls import call
from orchestrator.remote.routing import version
from orchestrator.remote.ssh import SSH_FAILED, Connection

#: Import names of distributions whose name differs.
_IMPORT_NAMES = {"pyyaml": "yaml"}

_BOOTSTRAP = r"""
import json, os, shutil, subprocess, sys, tarfile, tempfile
venv, deps = os.path.expanduser(sys.argv[1]), json.loads(sys.argv[2])
python = os.path.join(venv, "bin", "python")
if not os.path.exists(python):
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
lib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     check=True, capture_output=True, text=True).stdout.strip()
with tempfile.TemporaryDirectory() as tmp:
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|*") as tar:
        tar.extractall(tmp, filter="data")
    shutil.rmtree(os.path.join(lib, "orchestrator"), ignore_errors=True)
    shutil.copytree(os.path.join(tmp, "orchestrator"), os.path.join(lib, "orchestrator"))
    wheels = os.path.join(tmp, "wheels")
    if os.path.isdir(wheels) and os.listdir(wheels):
        found = [os.path.join(wheels, w) for w in sorted(os.listdir(wheels))]
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, *found],
                       check=True, stdout=sys.stderr)
probe = "import importlib.util, json, sys, orchestrator; print(json.dumps([orchestrator.__version__, " \
        "[m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]]))"
print(subprocess.run([python, "-c", probe, *deps], check=True, capture_output=True, text=True).stdout)
"""


def dependencies() -> dict[str, str]:
    """The login side's dependencies (no extras): import name -> requirement, from this install."""
    out: dict[str, str] = {}
    for req in metadata.requires("orchestrator") or []:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        dist = name.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip().lower()
        out[_IMPORT_NAMES.get(dist, dist)] = name
    return out


def data_folders() -> dict[str, Path]:
    """The package's data folders, wherever this install keeps them: inside the package (a wheel) or
    beside it (an editable install from a checkout maps ``orchestrator.job_templates`` to the
    checkout's ``job_templates/``): the login host needs both to render and to find profiles."""
    from orchestrator.config.profile.load import builtin_profiles_dir
    from orchestrator.config.render import templates_dir

    return {"job_templates": templates_dir(), "cluster_profiles": builtin_profiles_dir()}


def _no_caches(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in info.name else info


def package_tar(wheels: Path | None) -> bytes:
    """This laptop's ``orchestrator`` package (no caches), with its data folders inside it, and the
    wheels of ``wheels``."""
    package = Path(__file__).resolve().parents[1]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(package, arcname="orchestrator", filter=_no_caches)
        for name, folder in data_folders().items():
            if not folder.resolve().is_relative_to(package):  # an editable install: beside the package
                tar.add(folder, arcname=f"orchestrator/{name}", filter=_no_caches)
        for wheel in sorted(wheels.glob("*.whl")) if wheels else []:
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    return buf.getvalue()


def install(profile: ClusterProfile, name: str, wheels: Path | None) -> list[str]:
    """Install or update orchestrator on the login host; the lines to print (raises when a
    dependency is still missing there, naming the fix)."""
    __version__ = version()

    python = profile.login.python
    if not python.endswith("/bin/python"):
        raise UserError(
            f"login.python {python!r} of profile {name} is no venv's interpreter (.../bin/python): "
            "set it to ~/.orchestrator/venv/bin/python, where install puts one"
        )
    if wheels is not None and not wheels.is_dir():
        raise UserError(f"--wheels {wheels}: no such folder")
    venv = python[: -len("/bin/python")]
    deps = dependencies()
    conn = Connection(profile.login)
    conn.ensure_master()
    line = shlex.join(["python3", "-c", _BOOTSTRAP, venv, json.dumps(sorted(deps))])
    rc, out, said = call(conn, line, stdin=package_tar(wheels))
    if rc == SSH_FAILED:
        raise conn.failure(said)
    if rc != 0:
        raise UserError(
            f"install on {conn.host} failed: {said.strip().splitlines()[-1] if said.strip() else rc}"
        )
    there, missing = json.loads(out.decode().strip().splitlines()[-1])
    lines = [f"orchestrator {there} installed on {conn.host} in {venv}"]
    if there != __version__:
        raise UserError(f"installed {there} on {conn.host}, expected {__version__}")
    if missing:
        reqs = " ".join(shlex.quote(deps[m]) for m in missing)
        raise UserError(
            f"orchestrator {there} is on {conn.host}, but these do not import there: {', '.join(missing)}; "
            f"on this laptop run `pip download --dest wheels --only-binary=:all: {reqs}` (add --python-version "
            f"and --platform for the login host's), then `orchestrator remote install {name} --wheels wheels`"
        )
    return lines
