import pytest

from ember.store import Store
from tests.store.backend import fresh_database


@pytest.fixture
def db_url(tmp_path):
    with fresh_database(tmp_path) as url:
        yield url


@pytest.fixture
def store(db_url):
    s = Store.open(db_url)
    yield s
    s.close()
