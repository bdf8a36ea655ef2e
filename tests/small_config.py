"""configs/tiny.py shrunk for tests (tests/conftest.py `small_train_config`), as a
config file for train.py: `python train.py --config=tests/small_config.py ...`."""

from tests.conftest import small_train_config


def get_config():
    return small_train_config()
