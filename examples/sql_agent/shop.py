"""The shop database the SQL agent queries, and templated questions with gold SQL over it.

Everything is generated from a seed: three related tables (customers, products, orders) and several hundred
questions from eleven templates. The split puts each (template, value) combination in one split only, so the
held-out questions ask about values the model never saw with that question during training.
"""

from __future__ import annotations

import itertools
import random
import sqlite3
from pathlib import Path
from typing import Any

SCHEMA = (
    "customers(id, name, city); products(id, name, category, price); "
    "orders(id, customer_id, product_id, quantity)"
)
_CITIES = ["Paris", "Lyon", "Oslo", "Rome", "Porto", "Bern", "Riga", "Kyiv", "Graz", "Bonn"]
_FIRST = ["Anna", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon"]
_LAST = ["Berg", "Costa", "Novak", "Smith"]
_PRODUCTS = {
    "fruit": ["apple", "banana", "cherry", "mango", "pear", "plum", "lemon"],
    "bakery": ["bagel", "bread", "croissant", "muffin", "pretzel", "scone"],
    "dairy": ["butter", "cheese", "cream", "milk", "yogurt", "kefir"],
    "drinks": ["coffee", "juice", "soda", "tea", "water", "cocoa", "cider"],
    "snacks": ["chips", "cookies", "nuts", "popcorn", "crackers", "candy"],
}

# (question, gold SQL); {city}, {customer}, {product}, {category} and {n} are filled from the database
TEMPLATES: list[tuple[str, str]] = [
    ("How many customers live in {city}?", "SELECT COUNT(*) FROM customers WHERE city = '{city}'"),
    ("What is the price of the {product}?", "SELECT price FROM products WHERE name = '{product}'"),
    ("Which city does {customer} live in?", "SELECT city FROM customers WHERE name = '{customer}'"),
    (
        "How many products are in the {category} category?",
        "SELECT COUNT(*) FROM products WHERE category = '{category}'",
    ),
    ("How many products cost more than {n} dollars?", "SELECT COUNT(*) FROM products WHERE price > {n}"),
    (
        "How many orders did {customer} place?",
        "SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
        "WHERE customers.name = '{customer}'",
    ),
    (
        "How many units of the {product} were ordered in total?",
        "SELECT SUM(quantity) FROM orders JOIN products ON orders.product_id = products.id "
        "WHERE products.name = '{product}'",
    ),
    (
        "What is the most expensive product in the {category} category?",
        "SELECT name FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT 1",
    ),
    ("Which customers live in {city}?", "SELECT name FROM customers WHERE city = '{city}'"),
    (
        "How many {category} products cost more than {n} dollars?",
        "SELECT COUNT(*) FROM products WHERE category = '{category}' AND price > {n}",
    ),
    (
        "Which {category} products cost less than {n} dollars?",
        "SELECT name FROM products WHERE category = '{category}' AND price < {n}",
    ),
]


def build_database(path: Path, seed: int = 0) -> Path:
    """Write the shop database to ``path`` (replacing it) and return the path."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);"
            "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price INTEGER);"
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, "
            "quantity INTEGER);"
        )
        names = [f"{first} {last}" for last in _LAST for first in _FIRST]
        db.executemany(
            "INSERT INTO customers (name, city) VALUES (?, ?)", [(n, rng.choice(_CITIES)) for n in names]
        )
        products = [(name, cat, rng.randint(1, 40)) for cat, items in _PRODUCTS.items() for name in items]
        db.executemany("INSERT INTO products (name, category, price) VALUES (?, ?, ?)", products)
        orders = [
            (rng.randint(1, len(names)), rng.randint(1, len(products)), rng.randint(1, 9)) for _ in range(300)
        ]
        db.executemany("INSERT INTO orders (customer_id, product_id, quantity) VALUES (?, ?, ?)", orders)
    return path


def _values(db: sqlite3.Connection) -> dict[str, list[Any]]:
    return {
        "city": sorted({r[0] for r in db.execute("SELECT city FROM customers")}),
        "customer": [r[0] for r in db.execute("SELECT name FROM customers ORDER BY id")],
        "product": [r[0] for r in db.execute("SELECT name FROM products ORDER BY id")],
        "category": sorted(_PRODUCTS),
        "n": list(range(5, 40, 3)),
    }


def make_questions(path: Path) -> list[dict[str, Any]]:
    """Every (template, values) question over the database at ``path``: question, gold SQL, template index."""
    with sqlite3.connect(path) as db:
        values = _values(db)
    questions = []
    for index, (question, sql) in enumerate(TEMPLATES):
        slots = [k for k in values if "{" + k + "}" in question]
        for combo in itertools.product(*(values[k] for k in slots)):
            filled = dict(zip(slots, combo, strict=True))
            questions.append(
                {"question": question.format(**filled), "sql": sql.format(**filled), "template": index}
            )
    return questions


def run_query(path: Path | str, sql: str, max_rows: int = 20) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` on a read-only connection; a runaway query is stopped after ~1M VM steps."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    steps = [0]

    def guard() -> int:
        steps[0] += 1
        return 1 if steps[0] > 1000 else 0  # called every 1,000 instructions

    db.set_progress_handler(guard, 1000)
    try:
        return db.execute(sql).fetchmany(max_rows)
    finally:
        db.close()


def format_rows(rows: list[tuple[Any, ...]]) -> str:
    """Rows as the tool shows them to the model: one per line, values joined by ', '."""
    if not rows:
        return "(no rows)"
    return "\n".join(", ".join(str(v) for v in row) for row in rows)


def same_result(path: Path | str, sql: str, gold_sql: str) -> bool:
    """Execution match: ``sql`` returns the gold rows (in order when the gold query orders them)."""
    try:
        got = run_query(path, sql)
    except sqlite3.Error:
        return False
    want = run_query(path, gold_sql)
    if "ORDER BY" in gold_sql.upper():
        return got == want
    return sorted(map(repr, got)) == sorted(map(repr, want))
