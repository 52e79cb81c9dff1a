"""The LangGraph SQL recipe: its database and split keep held-out questions honest, and its reward is
execution match on a read-only, bounded connection."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from examples.heldout import split_by_template
from examples.sql_agent.shop import build_database, make_questions, run_query, same_result


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_database(tmp_path_factory.mktemp("shop") / "shop.db")


def test_split_holds_out_unseen_combinations_from_every_template(shop: Path) -> None:
    questions = make_questions(shop)
    assert len(questions) >= 300
    train, test = split_by_template(questions, test=64, key="question")
    assert len(test) == 64 and len(train) + len(test) == len(questions)
    assert not {q["question"] for q in train} & {q["question"] for q in test}
    for template in {q["template"] for q in questions}:
        total = sum(q["template"] == template for q in questions)
        held = sum(q["template"] == template for q in test)
        assert 1 <= held <= total // 3  # every template is tested, and mostly trained
    assert split_by_template(questions, test=64, key="question") == (train, test)  # stable
    with pytest.raises(ValueError, match="two thirds"):
        split_by_template(questions, test=len(questions) // 2, key="question")


def test_every_gold_query_runs_and_reward_is_execution_match(shop: Path) -> None:
    for q in make_questions(shop):
        run_query(shop, q["sql"])
    gold = "SELECT name FROM customers WHERE city = 'Oslo'"
    assert same_result(
        shop, "SELECT customers.name FROM customers WHERE city='Oslo' ORDER BY name DESC", gold
    )
    assert not same_result(shop, "SELECT name FROM customers WHERE city = 'Rome'", gold)
    assert not same_result(shop, "SELEC oops", gold)
    ordered = "SELECT name FROM products WHERE category = 'fruit' ORDER BY price DESC LIMIT 1"
    assert not same_result(
        shop, "SELECT name FROM products WHERE category = 'fruit' ORDER BY price LIMIT 1", ordered
    )


def test_queries_are_read_only_and_bounded(shop: Path) -> None:
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        run_query(shop, "DELETE FROM orders")
    runaway = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT COUNT(*) FROM n"
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        run_query(shop, runaway)
    assert run_query(shop, "SELECT COUNT(*) FROM orders") == [(300,)]
