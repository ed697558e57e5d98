"""One validated settings object per process.

Precedence: defaults < TOML file (``--config``) < environment < CLI flags.
This is the only module that reads the environment.

Each field's environment name is ``GNOSIS_<FIELD>`` upper-cased, except the ones in
``ENV_ALIASES`` that the deployed system already uses (``THOTH_LIQUID_MEMORY``): the names,
and ``SettingsError`` that quotes them, live in ``gnosis_daemon.setting_names``.
The supervisor hands its resolved settings to its children through ``to_env()``, so
a child started by the supervisor sees exactly the supervisor's values.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from gnosis_daemon import kv_event_keys
from gnosis_daemon.setting_names import ENV_PREFIX, SettingsError, env_name
from gnosis_daemon.setting_names import check as _check

__all__ = ["ENV_PREFIX", "Settings", "SettingsError", "env_name", "load_settings"]

# Settings a child must not inherit: only the supervisor talks to systemd (NotifyAccess=main).
_NOT_FOR_CHILDREN = frozenset({"notify_socket", "watchdog_usec"})
_SYSTEMD_CHILD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _default_runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/gnosis-daemon-{os.getuid()}"
    return str(Path(base) / "gnosis-daemon")


@dataclass(slots=True)
class Settings:
    # -- where things live
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct
    runtime_dir: str = field(default_factory=_default_runtime_dir)
    state_dir: str | None = None  # KV-session disk tier; None = <runtime_dir>/state
    model_cache_dir: str | None = None  # converted GGUF checkpoints; None = ~/.cache/gnosis-daemon
    # -- HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # name in /v1/models; None = derived from the model
    listen_backlog: int = 2048  # the HTTP socket's accept queue (hypercorn's default is 100)
    max_request_bytes: int = 32 * 1024 * 1024  # largest HTTP request body; past it, 413
    max_inflight_requests: int = 1024  # host: completions/embeddings in flight; past it, 429
    # The share of max_inflight_requests one tenant may hold (counted once its body is read);
    # past it that tenant is answered 429 while the others keep theirs. One tenant alone (no
    # keys, or every key in one tenant) may take the whole limit.
    max_inflight_tenant_share: float = 0.5
    # A response whose client accepts no byte for this long (it stopped reading: the
    # socket's buffers are full) is ended, its connection closed and its station request
    # cancelled, so its slot is free again; counted in gnosis_stalled_responses_total.
    stream_stall_timeout_s: float = 30.0
    # Station frames (bytes on the station socket; decoded, about 7 times that in memory)
    # the host holds for one request that its client has not taken yet; past it that request
    # alone is ended (its station request cancelled, an error event to its stream), the
    # station link reads on for the others.
    stream_buffer_bytes: int = 1024 * 1024
    # -- API keys: when either is set every /v1 route needs "Authorization: Bearer <key>"
    api_keys: str = ""  # comma-separated (a list in TOML); GNOSIS_API_KEYS
    # Sent as X-Gnosis-Replica on every response, so a client behind a router (and the
    # fleet drill) can tell which replica answered; in a Kubernetes StatefulSet set it to
    # the pod's name. Empty: no header.
    replica_name: str = ""
    api_keys_file: str | None = None  # one key a line, optionally followed by a tenant name
    health_requires_key: bool = False  # with keys set: /health and /metrics need one too
    # -- logging
    log_level: str = "info"
    log_format: str = "auto"  # auto | json | console
    # -- station
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int = 8192  # tokens per sequence (prompt + completion)
    max_tokens_default: int = 512
    max_frame_bytes: int = 16 * 1024 * 1024
    kv_cache_bytes: int = 512 * 1024 * 1024  # CPU KV pool budget
    kv_cache_gpu_fraction: float = 0.8  # of free GPU memory after loading weights
    kv_block_size: int = 16  # tokens per KV block
    max_batch_size: int = 32  # sequences decoded in one forward
    prefill_chunk_tokens: int = 512  # long prompts are prefilled in chunks of this many
    cpu_packed_linears: bool = True  # CPU fp32: linear layers through oneDNN, weights packed once
    # Llama-family models: the decoder's forward in one loop over the same modules, without
    # transformers' per-call wrappers (bit for bit the same output); off: the model's forward.
    lean_decoder: bool = True
    # 4-bit Llama-family models on a CPU: each decode step in one C call (station/kernels/
    # cpu_step.c). auto: where it checks out and measures no slower than torch's layers
    # (kept per machine); on: wherever it checks out; off: decode through torch.
    cpu_decode_step: str = "auto"
    cpu_attention: str = "auto"  # the C step's: auto on bfloat16 pairs where the CPU has AVX512_BF16
    # Pure-decode steps replayed as CUDA graphs, one per (batch, context) bucket (station/
    # runtime/decode_graphs.py). auto: on a GPU; on: a CPU runs the same static step eagerly
    # (the CPU tests' way to check it); off: eager steps everywhere.
    decode_graphs: str = "auto"
    decode_graph_max_context: int = 8192  # longer contexts decode eagerly
    # The station's start check (station/plan/start_check.py): auto trusts the record of
    # one that passed for this model, build, machine and decode plan (model_cache_dir/
    # start-checks/), else runs it; always runs it at every start.
    start_check: str = "auto"
    # The decoder's linear weights in memory: auto keeps a GGUF file's 4-bit groups (Q4_0,
    # Q4_1, Q4_K) and int8 (Q8_0) and a float checkpoint's floats; int4 / int8 quantize the rest
    # at load; float dequantizes everything (docs/engine.md, "Weights that stay quantized").
    weights: str = "auto"
    # How a GGUF file is read (station/model/gguf_mapped.py): map builds the model straight from
    # the file's blocks, no float copy; convert has transformers write a float32 checkpoint to
    # model_cache_dir first; auto maps a Llama/Qwen file whose float32 copy would pass 1 GiB.
    gguf_load: str = "auto"
    tenant_salt: str = ""  # server-side secret mixed into prefix-cache keys
    max_waiting_requests: int = 256  # station: queued sequences; past it, generate gets capacity
    disable_capabilities: str = ""  # GNOSIS_STATION_DISABLE: stale-station drill
    # The tool-call parser: auto (from the chat template; generic where it renders no tools),
    tool_parser: str = "auto"  # ...or hermes, mistral, llama3, generic, none (no tools)
    # A grammar past grammar_max_nodes JSON values, or compiling past the timeout, is refused.
    grammar_max_nodes: int = 4096
    grammar_compile_timeout_s: float = 10.0
    # -- liquid memory
    liquid_memory: bool = True  # THOTH_LIQUID_MEMORY
    kv_session_budget: int = 256  # sessions kept before LRU expiry
    # The TTLs of Anthropic's cache_control classes ("5m", "1h"): each breakpoint is a pin
    # the station keeps this long after its last hit (short in tests).
    cache_ttl_5m_s: float = 300.0
    cache_ttl_1h_s: float = 3600.0
    # prompt_cache_retention "24h": the prompt's KV is pinned this long (refreshed on a hit).
    cache_retention_24h_s: float = 86400.0
    # /v1/responses: stored responses per tenant (least recently used past it are deleted)
    # and how long one is kept (its record under <state_dir>/responses, and its KV session).
    responses_max_per_tenant: int = 1000
    responses_ttl_s: float = 30 * 86400.0
    # A tenant holding more than this share of the session budget (or of the pool's pinned
    # blocks) loses its own LRU sessions first: it cannot evict another tenant's.
    kv_session_tenant_share: float = 0.5
    # generate's pins (TTL-pinned sessions, exempt from the budgets while live): a tenant's
    # pinned KV bytes past this are saved as ordinary sessions instead ("pin_budget").
    kv_pin_tenant_bytes: int = 2 * 1024 ** 3
    # The disk tier behind the KV pool (<state_dir>/kv-tier): every saved session is
    # written behind, evicted sessions stay there, and a restart finds them again.
    kv_persistence: bool = True
    kv_disk_bytes: int = 8 * 1024 ** 3  # the disk tier's budget (LRU sessions past it go)
    # The disk tier's quarantine/ (damaged files, kept intact for inspection) has a budget of
    # its own: past it the oldest quarantined files are deleted (counted). 0 keeps none.
    kv_quarantine_bytes: int = 1024 ** 3
    kv_write_behind_s: float = 1.0  # a saved session should be on disk within this; later is counted
    # The tier's I/O process reads and writes KV blocks in shared memory. CUDA: a staging
    # area of pinned host RAM between the GPU pool and the disk (0: 1 GiB). CPU: 0 shares
    # the pool itself (no copy); > 0 stages through an area of that size, as CUDA does.
    kv_host_bytes: int = 0
    # The CPU priority (nice, 0-19) the I/O process writes a young save at. 19 (and
    # SCHED_IDLE): it takes the cores decode leaves idle, and on a CPU host the writer waits
    # for decode steps to pause. From kv_write_behind_s / 4 after a save on (or with half the
    # pool queued) the rest is written at the station's own priority, so saves land while
    # decode keeps every core busy; reads back always run at the station's priority.
    # 0: every write at the station's priority at once.
    kv_io_nice: int = 19
    # A disk tier shared by a fleet (a read-write-many volume every replica mounts): the
    # tier lives at <kv_shared_dir>/<model> instead of <state_dir>/kv-tier/<model>, each
    # replica learns of the sessions the others write by rescanning the manifests every
    # kv_shared_scan_s, and a conversation whose replica died is read back from there.
    # Replicas sharing it need the same tenant_salt to share block files (else each stores
    # its own copy; sessions are found either way). Empty: the tier is this host's own.
    kv_shared_dir: str = ""
    kv_shared_scan_s: float = 1.0
    # -- KV events for token-aware routers (vLLM's format; docs/api.md, "Token-aware routing")
    # The ZMQ PUB endpoint the station publishes BlockStored / BlockRemoved /
    # AllBlocksCleared on, e.g. tcp://127.0.0.1:5557 (bound; empty: no events, the default).
    kv_events_endpoint: str = ""
    # An optional ZMQ ROUTER endpoint answering replay requests from the last batches.
    kv_events_replay_endpoint: str = ""
    # CURVE on both (gnosis_daemon/kv_event_keys.py): with API keys, needed off loopback.
    kv_events_curve_secret_file: str = ""  # the station's secret: a zmq.auth .key_secret file
    kv_events_curve_client_keys: str = ""  # clients let in: Z85 keys, .key files, dirs of them
    kv_events_advertise_host: str = ""  # /kv_event_sources' host for a wildcard (else hostname)
    kv_events_queue: int = 10000  # events waiting for the sender; past it they are dropped
    kv_events_buffer_steps: int = 10000  # batches kept for replay
    # -- timeouts and supervision (seconds)
    request_timeout_s: float = 600.0
    station_start_timeout_s: float = 300.0
    host_start_timeout_s: float = 60.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures_before_kill: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    min_uptime_s: float = 10.0
    max_fast_failures: int = 5
    drain_grace_s: float = 30.0
    stop_timeout_s: float = 10.0
    # A stuck station fails its health check (restarted like a hung one): its engine loop not
    # turned with work pending, or every tokenizer worker on one job, for this long.
    engine_stall_s: float = 60.0
    tokenizer_stall_s: float = 60.0
    # -- systemd (read from NOTIFY_SOCKET / WATCHDOG_USEC; never passed to children)
    notify_socket: str | None = None
    watchdog_usec: int | None = None

    def __post_init__(self) -> None:
        _check(self.port, 0 <= self.port <= 65535, "port", "an integer between 0 and 65535")
        _check(self.log_level, self.log_level.lower() in
               {"debug", "info", "warning", "error", "critical"}, "log_level",
               "one of debug, info, warning, error, critical")
        self.log_level = self.log_level.lower()
        _check(self.log_format, self.log_format in {"auto", "json", "console"}, "log_format",
               "one of auto, json, console")
        _check(self.device, self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:"),
               "device", "auto, cpu, cuda or cuda:N")
        _check(self.dtype, self.dtype in {"auto", "float32", "bfloat16", "float16"}, "dtype",
               "one of auto, float32, bfloat16, float16")
        _check(self.weights, self.weights in {"auto", "float", "int8", "int4"}, "weights",
               "one of auto, float, int8, int4")
        _check(self.gguf_load, self.gguf_load in {"auto", "convert", "map"}, "gguf_load",
               "one of auto, convert, map")
        _check(self.cpu_decode_step, self.cpu_decode_step in {"auto", "on", "off"}, "cpu_decode_step",
               "one of auto, on, off")
        _check(self.cpu_attention, self.cpu_attention in {"auto", "float32"}, "cpu_attention", "auto or float32")
        _check(self.decode_graphs, self.decode_graphs in {"auto", "on", "off"}, "decode_graphs",
               "one of auto, on, off")
        _check(self.start_check, self.start_check in {"auto", "always"}, "start_check",
               "one of auto, always")
        parsers = ("auto", "hermes", "mistral", "llama3", "generic", "none")
        _check(self.tool_parser, self.tool_parser in parsers, "tool_parser", f"one of {', '.join(parsers)}")
        for name in ("max_model_len", "max_tokens_default", "max_frame_bytes", "kv_cache_bytes",
                     "kv_block_size", "max_batch_size", "prefill_chunk_tokens",
                     "kv_session_budget", "health_failures_before_kill", "max_fast_failures",
                     "listen_backlog", "max_request_bytes", "max_inflight_requests",
                     "stream_buffer_bytes",
                     "max_waiting_requests", "kv_disk_bytes", "kv_events_queue",
                     "kv_events_buffer_steps", "decode_graph_max_context", "grammar_max_nodes",
                     "responses_max_per_tenant", "kv_pin_tenant_bytes"):
            value = getattr(self, name)
            _check(value, value > 0, name, "a positive integer")
        _check(self.kv_io_nice, 0 <= self.kv_io_nice <= 19, "kv_io_nice", "an integer from 0 to 19")
        _check(self.kv_quarantine_bytes, self.kv_quarantine_bytes >= 0, "kv_quarantine_bytes",
               "0 (keep no damaged file) or a number of bytes")
        _check(self.kv_host_bytes, self.kv_host_bytes >= 0, "kv_host_bytes",
               "0 (the default size) or a number of bytes")
        _check(self.kv_write_behind_s, self.kv_write_behind_s > 0, "kv_write_behind_s",
               "a positive number of seconds")
        _check(self.kv_cache_gpu_fraction, 0 < self.kv_cache_gpu_fraction <= 1,
               "kv_cache_gpu_fraction", "a number in (0, 1]")
        _check(self.kv_session_tenant_share, 0 < self.kv_session_tenant_share <= 1,
               "kv_session_tenant_share", "a number in (0, 1]")
        _check(self.max_inflight_tenant_share, 0 < self.max_inflight_tenant_share <= 1,
               "max_inflight_tenant_share", "a number in (0, 1]")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            _check(value, not value or (value.startswith(("tcp://", "ipc://"))
                                        and "=" not in value), name,
                   "empty (off) or a ZMQ endpoint to bind, e.g. tcp://*:5557")
        _check(self.kv_events_replay_endpoint,
               not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
               "kv_events_replay_endpoint", "empty unless kv_events_endpoint is set")
        if self.api_keys_file is not None:
            _check(self.api_keys_file, Path(self.api_keys_file).is_file(), "api_keys_file",
                   "an existing file of API keys (one a line, optionally followed by a tenant)")
        kv_event_keys.check(self)  # no prompt tokens on a socket anyone can read
        for f in fields(self):
            if f.name.endswith("_s"):
                value = getattr(self, f.name)
                _check(value, value > 0, f.name, "a positive number of seconds")
        _check(self.watchdog_usec, self.watchdog_usec is None or self.watchdog_usec > 0,
               "watchdog_usec", "a positive number of microseconds")
        _check(self.backoff_max_s, self.backoff_max_s >= self.backoff_initial_s, "backoff_max_s",
               "at least backoff_initial_s")
        if self.model is not None:
            _check(self.model, Path(self.model).exists(), "model",
                   "an existing HF model directory or .gguf file")

    # -- derived paths
    @property
    def station_socket(self) -> Path:
        return Path(self.runtime_dir) / "station.sock"

    @property
    def control_socket(self) -> Path:
        return Path(self.runtime_dir) / "control.sock"

    @property
    def status_file(self) -> Path:
        return Path(self.runtime_dir) / "status.json"

    @property
    def station_refusal_file(self) -> Path:
        """Written by a station that refuses its model (``ModelRefused``), removed by one that
        starts: what the supervisor, ``status`` and the host's ``/health`` report as the reason."""
        return Path(self.runtime_dir) / "station-refused.json"

    @property
    def effective_state_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir else Path(self.runtime_dir) / "state"

    @property
    def api_key_list(self) -> list[str]:
        """The keys of ``api_keys`` (``api_keys_file`` is read by the host)."""
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]

    @property
    def disabled_capabilities(self) -> frozenset[str]:
        return frozenset(c.strip() for c in self.disable_capabilities.split(",") if c.strip())

    def to_env(self) -> dict[str, str]:
        """Environment that rebuilds these exact settings in a child process."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _NOT_FOR_CHILDREN:
                continue
            if isinstance(value, bool):
                value = "1" if value else "0"
            env[env_name(f.name)] = str(value)
        return env

    def child_environ(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The full environment of a child process: ours, minus systemd's notify/socket
        variables (children must not notify), plus ``to_env()``."""
        base = dict(os.environ if environ is None else environ)
        for name in _SYSTEMD_CHILD_VARS:
            base.pop(name, None)
        base.update(self.to_env())
        return base

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(name: str, raw: Any, source: str) -> Any:
    ftype = _FIELD_TYPES[name]
    try:
        if raw is None:
            return None
        if "bool" in ftype:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(raw)
        if "int" in ftype:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(raw)
        if "float" in ftype:
            return float(raw)
        if name == "api_keys" and isinstance(raw, list):  # a TOML list: stored comma-separated
            if not all(isinstance(item, str) and "," not in item for item in raw):
                raise ValueError(raw)
            return ",".join(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise SettingsError(
            f"setting {name!r} from {source} has value {raw!r}, which is not a valid {ftype}"
        ) from None


_FIELD_TYPES = {f.name: str(f.type) for f in fields(Settings)}


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the one settings object: defaults < TOML < environment < CLI flags."""
    values: dict[str, Any] = {}
    environ = os.environ if environ is None else environ
    if config_file is None:
        config_file = environ.get(ENV_PREFIX + "CONFIG") or None
    if config_file is not None:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise SettingsError(f"config file {str(path)!r} does not exist (--config)") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        data = data.get("gnosis", data)
        for key, raw in data.items():
            name = key.replace("-", "_")
            if name not in _FIELD_TYPES:
                raise SettingsError(f"config file {str(path)!r} has unknown setting {key!r}")
            values[name] = _coerce(name, raw, f"config file {path}")
    for name in _FIELD_TYPES:
        raw = environ.get(env_name(name))
        if raw is not None and raw != "":
            values[name] = _coerce(name, raw, f"environment variable {env_name(name)}")
    for name, raw in (cli or {}).items():
        if raw is None:
            continue
        if name not in _FIELD_TYPES:
            raise SettingsError(f"unknown setting {name!r}")
        values[name] = _coerce(name, raw, f"flag --{name.replace('_', '-')}")
    return Settings(**values)
