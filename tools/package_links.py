"""Make a checkout importable as attention_jax without installing it: a folder of links.

    python tools/package_links.py SITE [CHECKOUT]     # then PYTHONPATH=SITE python ...

`pip install -e .` maps the import name onto the checkout's folders (pyproject.toml's
package-dir: model/ is attention_jax, data/ is attention_jax.data, ...). Where pip
cannot build (a machine without setuptools or network) or where a second checkout must
run beside the installed one (a benchmark comparing two commits), SITE/attention_jax is
made instead: a link to each file of model/ and to each subpackage's folder, so that
the checkout's code runs as it is, edits included. SITE first on PYTHONPATH wins over
an editable install of another checkout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_dirs(checkout: str) -> dict[str, str]:
    """The import name of each package -> its folder in `checkout` (pyproject.toml's)."""
    with open(os.path.join(checkout, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def link_package(site: str, checkout: str = ROOT) -> str:
    """Build SITE/<root package> from `checkout`'s folders (replacing an older one);
    returns its path."""
    checkout = os.path.abspath(checkout)
    mapping = package_dirs(checkout)
    (root, root_dir), *subpackages = sorted(mapping.items(), key=lambda kv: kv[0].count("."))
    target = os.path.join(site, root)
    if os.path.islink(target) or os.path.isfile(target):
        os.remove(target)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    source = os.path.join(checkout, root_dir)
    for name in sorted(os.listdir(source)):
        if name != "__pycache__":
            os.symlink(os.path.join(source, name), os.path.join(target, name))
    for package, folder in subpackages:
        parts = package.split(".")[1:]
        if len(parts) != 1:
            raise SystemExit(f"{package}: only one level of subpackages is linked")
        os.symlink(os.path.join(checkout, folder), os.path.join(target, parts[0]))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", help="the folder to put first on PYTHONPATH")
    parser.add_argument("checkout", nargs="?", default=ROOT, help="default: this checkout")
    args = parser.parse_args()
    print(link_package(args.site, args.checkout))


if __name__ == "__main__":
    main()
