"""Files another host writes into the shared run directory, seen as soon as the file server has them.

Several waits of a job poll for a file another host writes: a kept launcher for the batch step's word
(``next_attempt.json``), the batch step for every node's kept mark and exit file, each node for the
others' exit files, the nodes for node 0's published address. On NFS a lookup of a name that is not
there yet is cached as missing (a negative dentry), and the client trusts that miss until the
directory's cached attributes expire (``acdirmin``..``acdirmax``: 30-60 s by default). Linux,
``fs/nfs/dir.c``: a missing name is looked up again only when ``nfs_check_verifier`` finds the
directory changed, and it asks the server only once the attribute cache has timed out; opening
the file by its name does not change that (``nfs_neg_need_reval``). So a poller that looked before
the file existed could be told it is missing for up to a minute after it appeared, and a restart in
place that takes a second would take a minute there.

Opening the *directory* is an ``open(2)`` of it, and close-to-open consistency revalidates its
attributes on the wire (``nfs_lookup_verify_inode``: ``LOOKUP_OPEN`` on a directory without
``nocto``): a changed directory drops its stale misses and its cached listing. So these pollers list
the folder (one ``opendir`` per look) and read only the names the listing holds. On a local disk
this is one more small ``getdents``. A mount with ``nocto`` gives this up; ``lookupcache=positive``
(no cached misses) makes any look fresh.

Reasoned from the kernel's source, not measured here: this machine's kernel has no NFS client.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchestrator.contract.jsonfiles import read_json


def listed(folder: Path) -> frozenset[str]:
    """The names in ``folder`` as the file server has them now; empty if it cannot be listed."""
    try:
        return frozenset(os.listdir(folder))
    except OSError:
        return frozenset()


def read_text_listed(path: Path, names: frozenset[str] | None = None) -> str | None:
    """``path``'s text if a fresh listing of its folder holds it (``names``: that listing, when the
    caller took one for several files), else None."""
    path = Path(path)
    if path.name not in (listed(path.parent) if names is None else names):
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def read_json_listed(path: Path) -> dict[str, Any] | None:
    """:func:`~orchestrator.contract.jsonfiles.read_json` of ``path`` once a fresh listing holds it."""
    path = Path(path)
    return read_json(path) if path.name in listed(path.parent) else None
