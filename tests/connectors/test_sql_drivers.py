"""Which MySQL driver a SQL connection uses (connectors/sql_drivers.py): no server needed."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from connectors import sql_drivers

URL = make_url("mysql+pymysql://u:p@127.0.0.1:3306/shop")


def _without(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = sql_drivers.installed
    monkeypatch.setattr(sql_drivers, "installed", lambda m: m not in missing and real(m))


def test_auto_takes_connector_c_when_installed_whatever_the_url_names(monkeypatch):
    monkeypatch.delenv("FABRIC_SQL_DRIVER", raising=False)
    monkeypatch.setattr(sql_drivers, "installed", lambda m: True)
    assert sql_drivers.choose(URL).get_driver_name() == "mariadbconnector"
    assert sql_drivers.choose(URL, "url").get_driver_name() == "pymysql"
    assert sql_drivers.choose(URL, "pymysql").get_driver_name() == "pymysql"


def test_auto_falls_back_to_pymysql_without_the_fast_extra(monkeypatch):
    """A plain `pip install` (no libmariadb-dev, so no `mariadb` package) still reads."""
    monkeypatch.delenv("FABRIC_SQL_DRIVER", raising=False)
    _without(monkeypatch, "mariadb")
    assert sql_drivers.choose(URL).get_driver_name() == "pymysql"
    assert sql_drivers.choose(make_url("mysql://u:p@h/db")).get_driver_name() == "pymysql"


def test_a_forced_driver_that_is_missing_says_how_to_get_it(monkeypatch):
    _without(monkeypatch, "mariadb")
    with pytest.raises(ValueError, match=r"libmariadb-dev.*agent-data-fabric\[fast\]"):
        sql_drivers.choose(URL, "mariadbconnector")
    with pytest.raises(ValueError, match=r"unknown SQL driver 'odbc'.*pymysql"):
        sql_drivers.choose(URL, "odbc")


def test_the_environment_sets_the_default_and_other_databases_keep_their_driver(monkeypatch):
    monkeypatch.setenv("FABRIC_SQL_DRIVER", "pymysql")
    assert sql_drivers.choose(URL).get_driver_name() == "pymysql"
    pg = make_url("postgresql+psycopg://u:p@h/db")
    assert sql_drivers.choose(pg) is pg
