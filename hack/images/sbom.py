#!/usr/bin/env python3
"""Writes an SPDX 2.3 JSON SBOM of an image hack/images/build makes.

Usage: sbom.py --name REF --out FILE.spdx.json
               [--dpkg-status-tar ROOTFS.tar] [--site-packages DIR]...
               [--file NAME=VERSION=PATH]...

Lists the Debian packages of a rootfs tarball (its /var/lib/dpkg/status), the Python
distributions of site-packages directories (their *.dist-info/METADATA), and single
files (static binaries, pycriu) with their SHA-256, each with a package URL. Sorted and
stamped with $SOURCE_DATE_EPOCH: the same inputs give the same bytes, like the image.
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tarfile
import time
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

TOOL = "Tool: hermit-hack-images-sbom"


def dpkg_packages(rootfs_tar: Path) -> list[tuple[str, str, str]]:
    """(name, version, architecture) of every installed package in the tarball's dpkg status."""
    with tarfile.open(rootfs_tar) as tar:
        member = None
        for name in ("./var/lib/dpkg/status", "var/lib/dpkg/status"):
            try:
                member = tar.getmember(name)
                break
            except KeyError:
                continue
        if member is None:
            raise ValueError(f"{rootfs_tar} has no var/lib/dpkg/status")
        f = tar.extractfile(member)
        if f is None:
            raise ValueError(f"{rootfs_tar}: var/lib/dpkg/status is not a file")
        text = f.read().decode()
    out = []
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.MULTILINE))
        if "Package" in fields and "install ok installed" in fields.get("Status", ""):
            out.append((fields["Package"], fields.get("Version", ""),
                        fields.get("Architecture", "")))
    return sorted(out)


def python_distributions(site: Path) -> list[tuple[str, str]]:
    out = []
    for meta in site.glob("*.dist-info/METADATA"):
        headers = HeaderParser().parsestr(meta.read_text(errors="replace"))
        if headers.get("Name"):
            out.append((headers["Name"], headers.get("Version", "")))
    return sorted(out, key=lambda nv: (nv[0].lower(), nv[1]))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    if path.is_dir():  # a package directory (pycriu): its files, in order
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    else:
        h.update(path.read_bytes())
    return h.hexdigest()


def _spdx_id(kind: str, name: str) -> str:
    return f"SPDXRef-{kind}-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def _package(spdx_id: str, name: str, version: str, purl: str | None) -> dict[str, Any]:
    pkg: dict[str, Any] = {
        "SPDXID": spdx_id, "name": name, "versionInfo": version,
        "downloadLocation": "NOASSERTION", "filesAnalyzed": False,
        "licenseConcluded": "NOASSERTION", "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
    }
    if purl:
        pkg["externalRefs"] = [{"referenceCategory": "PACKAGE-MANAGER",
                                "referenceType": "purl", "referenceLocator": purl}]
    return pkg


def document(args: argparse.Namespace) -> dict[str, Any]:
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0") or "0")
    packages: list[dict[str, Any]] = []
    if args.dpkg_status_tar:
        for name, version, arch in dpkg_packages(Path(args.dpkg_status_tar)):
            packages.append(_package(_spdx_id("deb", name), name, version,
                                     f"pkg:deb/debian/{name}@{version}?arch={arch}"))
    seen: set[str] = set()
    for site in args.site_packages or []:
        for name, version in python_distributions(Path(site)):
            if name.lower() in seen:
                continue
            seen.add(name.lower())
            norm = re.sub(r"[-_.]+", "-", name).lower()
            packages.append(_package(_spdx_id("pypi", norm), name, version,
                                     f"pkg:pypi/{norm}@{version}"))
    for spec in args.file or []:
        name, version, path = spec.split("=", 2)
        pkg = _package(_spdx_id("file", name), name, version, None)
        pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": _sha256(Path(path))}]
        packages.append(pkg)
    image_id = "SPDXRef-Image"
    image = _package(image_id, args.name, args.name.rsplit(":", 1)[-1], None)
    digest = hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()[:32]
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": args.name,
        "documentNamespace": f"https://hermit.dev/spdx/{args.name.replace(':', '/')}/{digest}",
        "creationInfo": {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch)),
                         "creators": [TOOL]},
        "documentDescribes": [image_id],
        "packages": [image, *packages],
        "relationships": [
            {"spdxElementId": image_id, "relationshipType": "CONTAINS",
             "relatedSpdxElement": p["SPDXID"]} for p in packages
        ],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dpkg-status-tar")
    p.add_argument("--site-packages", action="append")
    p.add_argument("--file", action="append", help="NAME=VERSION=PATH")
    args = p.parse_args(argv)
    try:
        doc = document(args)
        out = Path(args.out)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        partial.replace(out)
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"sbom.py: {args.name}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
