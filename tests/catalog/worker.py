"""The subprocess side of the durability and concurrency tests (run as a script, then killed or waited for)."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mint_server.catalog import Catalog, NotFound  # noqa: E402
from tests.catalog.helpers import BASE_MODEL, LORA, write_peft  # noqa: E402

OWNER = "worker-owner"


def publish_forever(url: str, data_dir: str, policy: str, work: Path) -> None:
    """Publish ever-new revisions, each a child of the previous, until killed."""
    catalog = Catalog.open(url, data_dir=data_dir)
    try:
        parent = catalog.resolve(OWNER, policy)
    except NotFound:
        parent = None
    rng = random.Random()
    while True:
        peft = write_peft(work / "peft", rng.randrange(1 << 30), extra_bytes=1 << 20)
        parent = catalog.publish_revision(
            OWNER, policy, peft, base_model=BASE_MODEL, lora_config=LORA, parent=parent
        )
        print(parent.number, flush=True)
        shutil.rmtree(peft)


def move_alias(url: str, data_dir: str, policy: str, alias: str, moves: int, actor: str, go: Path) -> None:
    """Wait for the go file, then move `alias` at random among revisions 1-3 `moves` times."""
    catalog = Catalog.open(url, data_dir=data_dir)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    rng = random.Random(actor)
    for i in range(moves):
        catalog.set_alias(OWNER, policy, alias, rng.randint(1, 3), actor=actor, reason=f"move {i}")
    print("done", flush=True)


def seed_servable(url: str, data_dir: str, model: str, prefix: str, total: int, batch: int) -> None:
    """`mint catalog seed --servable` as a library call, printing a line per committed batch."""
    from mint_server.catalog.seed import seed
    from mint_server.cli.sweep import servable_payloads

    name, lora, payload_for = servable_payloads(Path(model), 1)
    catalog = Catalog.open(url, data_dir=data_dir)
    seed(catalog, total, owner=OWNER, prefix=prefix, batch_size=batch, payload_for=payload_for, base_model=name,
         lora_config=lora, resume=True, progress=lambda done: print(done, flush=True))


def import_dirs(url: str, data_dir: str, root: str, batch: int) -> None:
    """`mint catalog import-many` as a library call, printing a line per committed batch."""
    catalog = Catalog.open(url, data_dir=data_dir)
    items = [(f"imp-{d.name}", d) for d in sorted(Path(root).iterdir())]
    catalog.import_many(OWNER, items, batch_size=batch, progress=lambda done: print(done, flush=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish")
    p.add_argument("url")
    p.add_argument("data_dir")
    p.add_argument("policy")
    p.add_argument("work", type=Path)
    m = sub.add_parser("move")
    for name in ("url", "data_dir", "policy", "alias"):
        m.add_argument(name)
    m.add_argument("moves", type=int)
    m.add_argument("actor")
    m.add_argument("go", type=Path)
    sd = sub.add_parser("seed")
    for name in ("url", "data_dir", "model", "prefix"):
        sd.add_argument(name)
    sd.add_argument("total", type=int)
    sd.add_argument("batch", type=int)
    im = sub.add_parser("import")
    for name in ("url", "data_dir", "root"):
        im.add_argument(name)
    im.add_argument("batch", type=int)
    args = parser.parse_args()
    if args.cmd == "publish":
        publish_forever(args.url, args.data_dir, args.policy, args.work)
    elif args.cmd == "seed":
        seed_servable(args.url, args.data_dir, args.model, args.prefix, args.total, args.batch)
    elif args.cmd == "import":
        import_dirs(args.url, args.data_dir, args.root, args.batch)
    else:
        move_alias(args.url, args.data_dir, args.policy, args.alias, args.moves, args.actor, args.go)


if __name__ == "__main__":
    main()
