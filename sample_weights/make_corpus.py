"""Write sample_weights/english.txt: real English sentences for `attnviz corpus` (its examples,
tests and benchmark), taken offline from the documentation every Python installation ships —
the language reference's topics (pydoc_data.topics) and the docstrings of standard-library
modules, their classes and functions (Python Software Foundation License). One sentence per
line: 6 to 40 words of plain prose (no code, no markup), each once, in the order found.

    python sample_weights/make_corpus.py [--count N]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

PLAIN = re.compile(r"[A-Z][A-Za-z0-9 ,;:'()\-]*[a-z)][.!?]")
SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
MODULES = ("abc argparse array asyncio base64 bisect builtins bz2 calendar cmath codecs "
           "collections concurrent.futures configparser contextlib copy csv dataclasses datetime "
           "decimal difflib email enum fractions ftplib functools gc getopt gettext glob gzip "
           "hashlib heapq hmac html http.client imaplib inspect io ipaddress itertools json "
           "locale logging lzma mailbox math mimetypes mmap multiprocessing numbers operator "
           "optparse os pathlib pickle platform plistlib poplib pprint queue random re sched "
           "secrets select selectors shelve shlex shutil signal smtplib socket sqlite3 ssl stat "
           "statistics string struct subprocess tarfile tempfile textwrap threading time "
           "timeit tokenize traceback types typing unittest urllib.parse urllib.request uuid "
           "warnings weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib").split()


def texts() -> Iterator[str]:
    import pydoc_data.topics

    for key in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[key]
    for name in MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue
        yield inspect.getdoc(module) or ""
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            value = getattr(module, attr, None)
            if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
                yield inspect.getdoc(value) or ""


def sentences(count: int) -> list[str]:
    found: dict[str, None] = {}
    for text in texts():
        for paragraph in re.split(r"\n\s*\n", text):
            flat = " ".join(paragraph.split())
            for sentence in SPLIT.split(flat):
                if 6 <= len(sentence.split()) <= 40 and PLAIN.fullmatch(sentence):
                    found.setdefault(sentence)
                    if len(found) >= count:
                        return list(found)
    return list(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3000)
    args = parser.parse_args()
    lines = sentences(args.count)
    out = Path(__file__).with_name("english.txt")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} sentences to {out} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
