"""interlace as it was at another git ref, built in place: the "before" of a before/after run.

`python -m benchmarks --baseline REF` exports REF's tree with `git archive` into
`build/baseline-<sha>/` (`--baseline-dir` elsewhere), builds its compiled extension there with
this interpreter (`setup.py build_ext --inplace`), and measures it as one more contender, in
a worker process whose `sys.path` puts that tree's `src/` first (`measure.Worker`), taking
turns with the others in the same rounds. A tree already exported is reused; the build step
reruns but recompiles only what changed.

An export, not `git worktree add`: it registers nothing in the repository's `.git` (no stale
worktree entries to prune when a temporary tree is deleted) and works from any directory.

Everything that can go wrong here (no git, an unknown ref, a failing build) comes back as one
line saying so; the harness prints it and runs on without the baseline.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tarfile

#: Written into an exported tree once the export is complete: a tree without it is a partial
#: export of ours (interrupted), redone from scratch.
MARKER = ".interlace-baseline"


@dataclasses.dataclass(frozen=True)
class Baseline:
    ref: str        # as the user wrote it
    sha: str        # the commit it resolved to
    tree: str       # the exported, built tree
    src: str        # its src/, put first on the worker's sys.path

    @property
    def label(self) -> str:
        """`interlace@2eafd86 (native)`; a ref that is not a hash gets its hash too."""
        named = self.ref if self.sha.startswith(self.ref.lower()) else f"{self.ref} {self.sha[:7]}"
        return f"interlace@{named} (native)"


def prepare(ref: str, root: str, into: str, python: str = sys.executable, git: str | None = None,
            log=None) -> Baseline | str:
    """The built tree of `ref` (a git ref of the repository at `root`) under `into`, or one line
    saying why there is none. `python` builds the extension (the interpreter the run uses)."""
    git = git or shutil.which("git")
    if not git or not os.path.exists(git):
        return "git is not available on this machine"
    try:
        sha = _git(git, root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").strip()
    except (OSError, subprocess.CalledProcessError) as error:
        why = _last_line(error)
        return f"git cannot resolve {ref!r} to a commit in {root}" + ("" if why.startswith("exit") else f" ({why})")
    tree = os.path.join(os.path.abspath(into), f"baseline-{sha[:12]}")
    if not os.path.exists(os.path.join(tree, MARKER)):
        if log:
            log(f"baseline: exporting {ref} ({sha[:12]}) to {tree}")
        try:
            _export(git, root, sha, tree)
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as error:
            return f"exporting {ref} ({sha[:12]}) to {tree} failed: {_last_line(error)}"
    if log:
        log(f"baseline: building {ref}'s extension in place ({os.path.basename(python)} setup.py build_ext)")
    env = {k: v for k, v in os.environ.items() if k != "INTERLACE_NO_EXTENSIONS"}
    env["INTERLACE_REQUIRE_EXTENSIONS"] = "1"  # a failed build says so instead of falling back
    try:
        subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, env=env,
                       check=True, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as error:
        return f"building {ref}'s extension in {tree} failed: {_last_line(error)}"
    return Baseline(ref, sha, tree, os.path.join(tree, "src"))


def _git(git, root, *args) -> str:
    return subprocess.run([git, "-C", root, *args], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def _export(git, root, sha, tree) -> None:
    """`git archive sha` unpacked into `tree` (a partial tree of an earlier attempt is ours: redone)."""
    if os.path.exists(tree):
        shutil.rmtree(tree)
    os.makedirs(tree)
    with subprocess.Popen([git, "-C", root, "archive", "--format=tar", sha], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
            if hasattr(tarfile, "data_filter"):  # 3.11.4+: refuse links and paths leaving the tree
                archive.extractall(tree, filter="data")
            else:
                archive.extractall(tree)  # noqa: S202 - our own repository's archive
        err = proc.stderr.read().decode(errors="replace")
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, "git archive", stderr=err)
    with open(os.path.join(tree, MARKER), "w") as f:
        f.write(sha + "\n")


def _last_line(error) -> str:
    """The last non-empty line of what a failed command printed, else the error itself."""
    for stream in (getattr(error, "stderr", None), getattr(error, "stdout", None)):
        if isinstance(stream, bytes):
            stream = stream.decode(errors="replace")
        lines = [line for line in (stream or "").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    if isinstance(error, subprocess.CalledProcessError):
        return f"exit status {error.returncode}"
    return f"{type(error).__name__}: {error}"
