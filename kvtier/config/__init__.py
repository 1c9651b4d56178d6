"""kvtier's one config, read once from ``kv_connector_extra_config`` plus ``KVTIER_<KEY>``
environment overrides, validated once, then frozen.

The package's modules, one concept each: :mod:`kvtier.config.settings` (the config
itself: each key's parser, :class:`KVTierConfig`, :func:`load_config`),
:mod:`kvtier.config.values` (parsers of single values: sizes, numbers, text, variable
names, flags), :mod:`kvtier.config.urls` (the one reader of URLs: :class:`RemoteURL`) and
:mod:`kvtier.config.tenants` (tenant names, ``tenant_quotas``, ``pin_tenants``).

The rest of kvtier imports the public names from here (``from kvtier.config import
load_config``); a test that patches a module's global patches the module that owns it
(``kvtier.config.settings``).
"""

from __future__ import annotations

from kvtier.config.settings import AUTO_IO_THREADS as AUTO_IO_THREADS
from kvtier.config.settings import CLUSTER_SCHEMES as CLUSTER_SCHEMES
from kvtier.config.settings import COMPRESSIONS as COMPRESSIONS
from kvtier.config.settings import ENV_NAME_KEYS as ENV_NAME_KEYS
from kvtier.config.settings import ENV_PREFIX as ENV_PREFIX
from kvtier.config.settings import KEY_SETTINGS as KEY_SETTINGS
from kvtier.config.settings import KEYS as KEYS
from kvtier.config.settings import LOAD_POLICIES as LOAD_POLICIES
from kvtier.config.settings import MAX_SIZE_BYTES as MAX_SIZE_BYTES
from kvtier.config.settings import NON_KEY_ENV as NON_KEY_ENV
from kvtier.config.settings import REMOTE_SCHEMES as REMOTE_SCHEMES
from kvtier.config.settings import SECURITY_KEYS as SECURITY_KEYS
from kvtier.config.settings import SHUTDOWN_MARGIN_S as SHUTDOWN_MARGIN_S
from kvtier.config.settings import SIZE_HELP as SIZE_HELP
from kvtier.config.settings import SIZE_KEYS as SIZE_KEYS
from kvtier.config.settings import VLLM_WORKER_SHUTDOWN_ENV as VLLM_WORKER_SHUTDOWN_ENV
from kvtier.config.settings import WARMUP_SHARE as WARMUP_SHARE
from kvtier.config.settings import WRITE_POLICIES as WRITE_POLICIES
from kvtier.config.settings import KVTierConfig as KVTierConfig
from kvtier.config.settings import RemoteKind as RemoteKind
from kvtier.config.settings import RemoteURL as RemoteURL
from kvtier.config.settings import auto_io_threads as auto_io_threads
from kvtier.config.settings import cluster_seeds as cluster_seeds
from kvtier.config.settings import format_size as format_size
from kvtier.config.settings import insecure_tls_args as insecure_tls_args
from kvtier.config.settings import is_known_non_key_env as is_known_non_key_env
from kvtier.config.settings import load_config as load_config
from kvtier.config.settings import note_sizes as note_sizes
from kvtier.config.settings import parse_remote as parse_remote
from kvtier.config.settings import parse_size as parse_size
from kvtier.config.settings import redact_url as redact_url
from kvtier.config.settings import redact_value as redact_value
from kvtier.config.settings import secret_in_config as secret_in_config
from kvtier.config.settings import unknown_key_error as unknown_key_error
from kvtier.config.settings import usable_cpus as usable_cpus
from kvtier.config.settings import warn_unknown_env as warn_unknown_env
from kvtier.errors import ConfigError as ConfigError
