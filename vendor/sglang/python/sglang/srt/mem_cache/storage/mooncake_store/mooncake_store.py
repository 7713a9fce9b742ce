import ctypes
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import requests
import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    SidecarPoolSpec,
    disabled_l3_layout,
)
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import DevicePoolEntry
from sglang.srt.mem_cache.pool_host import HostKVCache, HostTensorAllocator
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024 * 1024  # 16 MB
SETUP_TIMEOUT = 600  # 10min
DEFAULT_TENANT_ID = "default"

logger = logging.getLogger(__name__)


class MooncakeHostTensorAllocator(HostTensorAllocator):
    def __init__(self):
        super().__init__()
        from mooncake.store import MooncakeHostMemAllocator

        self.allocator = MooncakeHostMemAllocator()
        self.ptr = None

    def allocate(
        self, dims: tuple, dtype: torch.dtype, device: str = "cpu"
    ) -> torch.Tensor:
        """
        Allocates memory using MooncakeHostMemAllocator and wraps it in a PyTorch tensor.
        """
        self.dims = dims
        self.dtype = dtype
        size = 1
        for d in dims:
            size *= d
        size *= torch.tensor([], dtype=self.dtype).element_size()
        ptr_int = self.allocator.alloc(size)
        if not ptr_int:
            raise RuntimeError(
                f"MooncakeHostMemAllocator.alloc returned a null pointer for "
                f"{size / 1024**3:.3f} GB ({size} bytes); the mooncake host memory "
                f"allocator could not map the segment (check host memory "
                f"availability and the mooncake allocator logs)."
            )
        self.ptr = ptr_int
        c_type = ctypes.c_byte * size
        c_array = c_type.from_address(ptr_int)

        tensor = torch.frombuffer(c_array, dtype=torch.uint8, count=size)

        if dtype != torch.uint8:
            element_size = torch.tensor([], dtype=dtype).element_size()
            assert size % element_size == 0, "Size must be divisible by element size"
            tensor = tensor.view(dtype)

        return tensor.view(dims)


def _parse_global_segment_size(value) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        if s.endswith("gb"):
            num = s[:-2].strip()
            if not num:
                raise ValueError(
                    "Invalid global_segment_size: missing number before 'gb'"
                )
            return int(num) * 1024 * 1024 * 1024
        return int(s)
    return int(value)


def _normalize_tenant_id(value) -> str:
    if value is None:
        return DEFAULT_TENANT_ID
    tenant_id = str(value).strip()
    return tenant_id if tenant_id else DEFAULT_TENANT_ID


@dataclass
class MooncakeStoreConfig:
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    protocol: str
    device_name: str
    master_server_address: str
    master_metrics_port: int
    check_server: bool
    standalone_storage: bool
    client_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: Optional[str] = None
    tenant_id: str = DEFAULT_TENANT_ID

    @staticmethod
    def _resolve_local_hostname(overrides: Optional[dict] = None) -> str:
        """Resolve local_hostname for the current process.

        Process environment takes precedence over config overrides so multi-node
        runtime attach can broadcast shared extra_config while each node uses its
        own MOONCAKE_LOCAL_HOSTNAME / LOCAL_HOSTNAME.
        """
        if envs.MOONCAKE_LOCAL_HOSTNAME.is_set():
            return envs.MOONCAKE_LOCAL_HOSTNAME.get()
        local_hostname = os.getenv("LOCAL_HOSTNAME")
        if local_hostname:
            return local_hostname
        if overrides is not None:
            value = overrides.get("local_hostname")
            if value:
                return value
        return envs.MOONCAKE_LOCAL_HOSTNAME.default

    @staticmethod
    def from_file() -> "MooncakeStoreConfig":
        """Load the config from a JSON file."""
        if not envs.SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.is_set():
            raise RuntimeError(
                f"Config file path not set. Please set {envs.SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.name}"
            )
        file_path = envs.SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.get()
        try:
            with open(file_path) as fin:
                config = json.load(fin)
        except Exception as e:
            raise RuntimeError(f"Failed to load config from {file_path}: {str(e)}")

        if (
            "master_server_address" not in config
            and "client_server_address" not in config
        ):
            raise ValueError(
                "Either master_server_address or client_server_address is required in config file"
            )

        return MooncakeStoreConfig(
            local_hostname=MooncakeStoreConfig._resolve_local_hostname(config),
            metadata_server=config.get(
                "metadata_server", envs.MOONCAKE_TE_META_DATA_SERVER.default
            ),
            global_segment_size=_parse_global_segment_size(
                config.get(
                    "global_segment_size", envs.MOONCAKE_GLOBAL_SEGMENT_SIZE.default
                )
            ),
            # Fall back to MOONCAKE_PROTOCOL (not its default) so an image or
            # deployment that sets it, e.g. MOONCAKE_PROTOCOL=efa, is honored
            # when the config file omits "protocol".
            protocol=config.get("protocol", envs.MOONCAKE_PROTOCOL.get()),
            device_name=config.get("device_name", envs.MOONCAKE_DEVICE.default),
            master_server_address=config.get(
                "master_server_address", envs.MOONCAKE_MASTER.default
            ),
            master_metrics_port=config.get(
                "master_metrics_port", envs.MOONCAKE_MASTER_METRICS_PORT.default
            ),
            check_server=config.get("check_server", envs.MOONCAKE_CHECK_SERVER.default),
            standalone_storage=config.get(
                "standalone_storage", envs.MOONCAKE_STANDALONE_STORAGE.default
            ),
            client_server_address=config.get(
                "client_server_address", envs.MOONCAKE_CLIENT.default
            ),
            enable_ssd_offload=config.get(
                "enable_ssd_offload", envs.MOONCAKE_ENABLE_SSD_OFFLOAD.default
            ),
            ssd_offload_path=config.get(
                "ssd_offload_path", envs.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH.default
            ),
            tenant_id=_normalize_tenant_id(
                config.get("tenant_id", envs.MOONCAKE_TENANT_ID.default)
            ),
        )

    @staticmethod
    def load_from_env() -> "MooncakeStoreConfig":
        """Load config from a file specified in the environment variable.
        export MOONCAKE_MASTER=10.13.3.232:50051
        export MOONCAKE_PROTOCOL="rdma"
        export MOONCAKE_DEVICE=""
        export MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE"
        """
        # other required environment variables...
        if not envs.MOONCAKE_MASTER.is_set() and not envs.MOONCAKE_CLIENT.is_set():
            raise ValueError(
                "Either the environment variable 'MOONCAKE_MASTER' or 'MOONCAKE_CLIENT' is not set."
            )

        return MooncakeStoreConfig(
            local_hostname=MooncakeStoreConfig._resolve_local_hostname(),
            metadata_server=envs.MOONCAKE_TE_META_DATA_SERVER.get(),
            global_segment_size=_parse_global_segment_size(
                envs.MOONCAKE_GLOBAL_SEGMENT_SIZE.get()
            ),
            protocol=envs.MOONCAKE_PROTOCOL.get(),
            device_name=envs.MOONCAKE_DEVICE.get(),
            master_server_address=envs.MOONCAKE_MASTER.get(),
            master_metrics_port=envs.MOONCAKE_MASTER_METRICS_PORT.get(),
            check_server=envs.MOONCAKE_CHECK_SERVER.get(),
            standalone_storage=envs.MOONCAKE_STANDALONE_STORAGE.get(),
            client_server_address=envs.MOONCAKE_CLIENT.get(),
            enable_ssd_offload=envs.MOONCAKE_ENABLE_SSD_OFFLOAD.get(),
            ssd_offload_path=envs.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH.get(),
            tenant_id=_normalize_tenant_id(envs.MOONCAKE_TENANT_ID.get()),
        )

    @staticmethod
    def load_from_extra_config(extra_config: dict) -> "MooncakeStoreConfig":
        """Load config from extra_config dictionary."""
        if (
            "master_server_address" not in extra_config
            and "client_server_address" not in extra_config
        ):
            raise ValueError(
                "Either master_server_address or client_server_address is required in extra_config"
            )

        return MooncakeStoreConfig(
            local_hostname=MooncakeStoreConfig._resolve_local_hostname(extra_config),
            metadata_server=extra_config.get(
                "metadata_server", envs.MOONCAKE_TE_META_DATA_SERVER.default
            ),
            global_segment_size=_parse_global_segment_size(
                extra_config.get(
                    "global_segment_size", envs.MOONCAKE_GLOBAL_SEGMENT_SIZE.default
                )
            ),
            # See from_file(): honor MOONCAKE_PROTOCOL when "protocol" is omitted.
            protocol=extra_config.get("protocol", envs.MOONCAKE_PROTOCOL.get()),
            device_name=extra_config.get("device_name", envs.MOONCAKE_DEVICE.default),
            master_server_address=extra_config.get(
                "master_server_address", envs.MOONCAKE_MASTER.default
            ),
            master_metrics_port=extra_config.get(
                "master_metrics_port", envs.MOONCAKE_MASTER_METRICS_PORT.default
            ),
            check_server=extra_config.get(
                "check_server", envs.MOONCAKE_CHECK_SERVER.default
            ),
            standalone_storage=extra_config.get(
                "standalone_storage", envs.MOONCAKE_STANDALONE_STORAGE.default
            ),
            client_server_address=extra_config.get(
                "client_server_address", envs.MOONCAKE_CLIENT.default
            ),
            enable_ssd_offload=extra_config.get(
                "enable_ssd_offload", envs.MOONCAKE_ENABLE_SSD_OFFLOAD.default
            ),
            ssd_offload_path=extra_config.get(
                "ssd_offload_path", envs.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH.default
            ),
            tenant_id=_normalize_tenant_id(
                extra_config.get("tenant_id", envs.MOONCAKE_TENANT_ID.default)
            ),
        )


class MooncakeBaseStore:
    def __init__(self):
        self.store = None
        self.config = None

    def _import_mooncake_store(self):
        try:
            from mooncake.store import MooncakeDistributedStore

            return MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "Please install mooncake by following the instructions at "
                "https://kvcache-ai.github.io/Mooncake/getting_started/build.html "
                "to run SGLang with MooncakeConnector."
            ) from e

    def _replicate_config_supports(self, field: str) -> bool:
        cls = getattr(self, "_replicate_config_cls", None)
        if cls is None:
            return False
        if hasattr(cls, field):
            return True
        try:
            return hasattr(cls(), field)
        except Exception:
            return False

    def _import_mooncake_group_semantics(self):
        try:
            from mooncake.store import ReplicateConfig
        except ImportError:
            return None, False

        supports_group_ids = hasattr(ReplicateConfig, "group_ids")
        if not supports_group_ids:
            try:
                supports_group_ids = hasattr(ReplicateConfig(), "group_ids")
            except Exception:
                supports_group_ids = False
        return ReplicateConfig, supports_group_ids

    def _load_config(self, storage_config: Any = None):
        extra_config = (
            getattr(storage_config, "extra_config", None) if storage_config else None
        )

        if extra_config and (
            extra_config.get("master_server_address") is not None
            or extra_config.get("client_server_address") is not None
        ):
            config = MooncakeStoreConfig.load_from_extra_config(extra_config)
            logger.info("Mooncake Configuration loaded from extra_config successfully.")

        elif envs.SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.is_set():
            config = MooncakeStoreConfig.from_file()
            logger.info("Mooncake Configuration loaded from file successfully.")

        else:
            config = MooncakeStoreConfig.load_from_env()
            logger.info("Mooncake Configuration loaded from env successfully.")

        return config

    def register_buffer(self, tensor: torch.Tensor):
        if self.store is None:
            raise RuntimeError("Mooncake store is not initialized.")
        ptr = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            # conv-only models have a 0-element ssm state; nothing to register
            return
        ret_code = self.store.register_buffer(ptr, size)
        if ret_code != 0:
            logger.error(f"Failed to register buffer, error code: {ret_code}")
            raise RuntimeError(
                f"Failed to register buffer to Mooncake Store, error code: {ret_code}"
            )


class MooncakeStore(HiCacheStorage, MooncakeBaseStore):
    @staticmethod
    def _standalone_required_bytes(mem_pool: Any) -> int:
        """Compute total bytes of host buffers that must be visible to the real client.

        In standalone (dummy client) mode, the real mooncake_client process needs
        to map any host buffers we will later pass by pointer via register_buffer().
        For hybrid models, that includes KV + sidecar pools (e.g. Mamba temporal/conv).
        """
        # Prefer a generic "hybrid pool" accessor when present.
        total = 0
        seen_ptrs: set[int] = set()

        def _add_tensor(t: Optional[torch.Tensor]):
            nonlocal total
            if t is None:
                return
            try:
                ptr = int(t.data_ptr())
            except Exception:
                return
            if ptr in seen_ptrs:
                return
            seen_ptrs.add(ptr)
            total += int(t.numel() * t.element_size())

        # Always include the anchor KV buffer if present.
        _add_tensor(getattr(mem_pool, "kv_buffer", None))

        # HostPoolGroup: include each pool's hybrid buffers when available.
        entries = getattr(mem_pool, "entries", None)
        if entries:
            for entry in entries:
                host_pool = getattr(entry, "host_pool", None)
                if host_pool is None:
                    continue
                # KV pool anchor memory is already covered, but harmless if added twice.
                _add_tensor(getattr(host_pool, "kv_buffer", None))
                for buf in getattr(host_pool, "get_hybrid_pool_buffer", lambda: [])():
                    _add_tensor(buf)
            return total

        # Single HostKVCache-like pool: add its sidecar buffers if any.
        for buf in getattr(mem_pool, "get_hybrid_pool_buffer", lambda: [])():
            _add_tensor(buf)
        return total

    def __init__(
        self, storage_config: HiCacheStorageConfig = None, mem_pool: HostKVCache = None
    ):
        MooncakeBaseStore.__init__(self)
        self.dcp_size = storage_config.dcp_size if storage_config is not None else 1
        MooncakeDistributedStore = self._import_mooncake_store()
        self._replicate_config_cls, self._supports_group_ids = (
            self._import_mooncake_group_semantics()
        )
        # Mooncake builds with ReplicateConfig.session_ids publish the writing
        # session on their stored KV events.
        self._supports_session_ids = self._replicate_config_supports("session_ids")
        try:
            self.store = MooncakeDistributedStore()

            self.config = self._load_config(storage_config)
            extra_config = (
                getattr(storage_config, "extra_config", None)
                if storage_config
                else None
            )
            self.enable_group_semantics = bool(
                extra_config.get("enable_group_semantics", False)
                if extra_config
                else False
            )
            self._use_group_semantics = (
                self.enable_group_semantics
                and self._supports_group_ids
                and self._replicate_config_cls is not None
            )
            if self.enable_group_semantics and not self._supports_group_ids:
                logger.warning(
                    "Mooncake group semantics is enabled, but the installed "
                    "Mooncake package does not support ReplicateConfig.group_ids. "
                    "Falling back to the existing batch_put_from path."
                )
            rank_scale_factor = (
                1
                if storage_config is None
                else (storage_config.tp_size * storage_config.pp_size)
            )

            per_rank_global_segment_size = (
                self.config.global_segment_size // rank_scale_factor
            )

            # Use the backend tag and model name as a prefix to isolate tenants
            # and models sharing one store.
            self.config_prefix = None
            config_prefix_parts = []
            if extra_config and extra_config.get("extra_backend_tag") is not None:
                config_prefix_parts.append(str(extra_config["extra_backend_tag"]))
            if storage_config is not None and storage_config.model_name:
                model_name = "-".join(storage_config.model_name.split("/"))
                config_prefix_parts.append(model_name)
            if self.dcp_size > 1:
                # DCP reuse is limited to matching topologies and logical pages.
                config_prefix_parts.append(
                    f"tp{storage_config.tp_size}_dcp{self.dcp_size}"
                    f"_page{storage_config.logical_page_size}"
                    f"_pp{storage_config.pp_size}_cp{storage_config.attn_cp_size}"
                )
            if config_prefix_parts:
                self.config_prefix = "_".join(config_prefix_parts)
                logger.info(f"Using Mooncake config prefix: {self.config_prefix}")

            # Check server status
            if self.config.check_server:
                self.check_server()

            # Handle JSON device_name configuration
            device_name = self.config.device_name
            if device_name and device_name.strip().startswith("{"):
                try:
                    device_config = json.loads(device_name)
                    if storage_config and hasattr(storage_config, "tp_rank"):
                        tp_rank = storage_config.tp_rank
                        # Try both integer and string keys since JSON parsing may convert keys
                        device_name = device_config.get(tp_rank, "")
                        if not device_name:
                            device_name = device_config.get(str(tp_rank), "")
                    else:
                        device_name = ""
                except (json.JSONDecodeError, AttributeError):
                    logger.warning(
                        f"Failed to parse device_name as JSON: {device_name}"
                    )
                    device_name = ""
            if self.config.standalone_storage:
                if not isinstance(mem_pool.allocator, MooncakeHostTensorAllocator):
                    raise RuntimeError(
                        "MooncakeStore with standalone_storage=True requires MooncakeHostTensorAllocator. "
                        "Please set standalone_storage=False "
                        "or upgrade Mooncake by 'pip install mooncake-transfer-engine --upgrade'."
                    )
                required_bytes = self._standalone_required_bytes(mem_pool)
                ret_code = self.store.setup_dummy(
                    required_bytes,
                    DEFAULT_LOCAL_BUFFER_SIZE,  # Zero copy interface does not need local buffer
                    self.config.client_server_address,
                )
            else:
                try:
                    from sglang.srt.distributed.parallel_state import (
                        get_mooncake_transfer_engine,
                    )

                    self._shared_mooncake_transfer_engine = (
                        get_mooncake_transfer_engine()
                    )
                except Exception:
                    self._shared_mooncake_transfer_engine = None
                    logger.debug("Failed to reuse initialized mooncake transfer engine")

                # Only reuse the shared MooncakeTransferEngine when its
                # configuration matches the one used by MooncakeStore.
                if (
                    self._shared_mooncake_transfer_engine is not None
                    and device_name
                    == self._shared_mooncake_transfer_engine.get_ib_device()
                    and self.config.metadata_server == "P2PHANDSHAKE"
                    and self.config.protocol == "rdma"
                ):
                    client_hostname = (
                        self._shared_mooncake_transfer_engine.get_session_id()
                    )
                    transfer_engine = self._shared_mooncake_transfer_engine.get_engine()
                    logger.info(
                        f"Reuse initialized mooncake transfer engine: {self._shared_mooncake_transfer_engine}"
                    )
                else:
                    client_hostname = self.config.local_hostname
                    transfer_engine = None

                setup_kwargs = {}
                if self.config.enable_ssd_offload:
                    setup_kwargs["enable_ssd_offload"] = True
                if self.config.ssd_offload_path is not None:
                    # Each rank embeds its own Mooncake client. Sharing one
                    # offload directory corrupts silently: bucket ids are
                    # generated per process and resumed from the same startup
                    # scan after a restart, and bucket files are opened with
                    # O_CREAT|O_TRUNC, so a filename collision truncates
                    # another rank's bucket. Give every rank a private subdir.
                    ssd_offload_path = self.config.ssd_offload_path
                    if storage_config is not None:
                        ssd_offload_path = os.path.join(
                            ssd_offload_path,
                            f"rank_{storage_config.dp_rank}"
                            f"_{storage_config.tp_rank}_{storage_config.pp_rank}"
                            f"_{storage_config.attn_cp_rank}",
                        )
                    os.makedirs(ssd_offload_path, exist_ok=True)
                    setup_kwargs["ssd_offload_path"] = ssd_offload_path
                if self.config.tenant_id != DEFAULT_TENANT_ID:
                    setup_kwargs["tenant_id"] = self.config.tenant_id

                while True:
                    try:
                        ret_code = self.store.setup(
                            client_hostname,
                            self.config.metadata_server,
                            per_rank_global_segment_size,
                            DEFAULT_LOCAL_BUFFER_SIZE,  # Zero copy interface does not need local buffer
                            self.config.protocol,
                            device_name,
                            self.config.master_server_address,
                            transfer_engine,
                            **setup_kwargs,
                        )
                        break
                    except TypeError as e:
                        unsupported_kwargs = [
                            key for key in list(setup_kwargs) if key in str(e)
                        ]
                        if not unsupported_kwargs:
                            raise
                        if "tenant_id" in unsupported_kwargs:
                            raise RuntimeError(
                                "The installed Mooncake version does not support "
                                "tenant_id in MooncakeDistributedStore.setup(). "
                                "Please upgrade Mooncake to use non-default "
                                "Mooncake tenants with SGLang."
                            ) from e
                        logger.warning(
                            "The installed Mooncake version does not support the "
                            f"{', '.join(unsupported_kwargs)} parameter(s) in setup(). "
                            f"Retrying without {', '.join(unsupported_kwargs)}. "
                            "Please upgrade Mooncake to enable SSD offload support."
                        )
                        for key in unsupported_kwargs:
                            setup_kwargs.pop(key, None)
            if ret_code:
                raise RuntimeError(
                    f"Failed to setup Mooncake store, error code: {ret_code}"
                )
            logger.info("Mooncake store setup successfully.")

            self.local_rank = (
                storage_config.tp_rank if storage_config is not None else 0
            )
            self.warmup()
            logger.info("Mooncake store warmup successfully.")

            self.enable_storage_metrics = False
            if storage_config is not None:
                self.is_mla_backend = storage_config.is_mla_model
                self.pp_rank = storage_config.pp_rank
                self.pp_size = storage_config.pp_size
                self.attn_cp_rank = storage_config.attn_cp_rank
                self.attn_cp_size = storage_config.attn_cp_size
                self.enable_storage_metrics = storage_config.enable_storage_metrics
            else:
                self.is_mla_backend = False
                self.local_rank = 0
                self.pp_rank = 0
                self.pp_size = 1
                self.attn_cp_rank = 0
                self.attn_cp_size = 1

            self.enable_pp = self.pp_size > 1
            if self.enable_pp:
                self.mha_suffix = f"{self.local_rank}_{self.pp_rank}"
                self.mla_suffix = f"{self.pp_rank}"
            else:
                self.mha_suffix = f"{self.local_rank}"
                self.mla_suffix = ""

            if self.dcp_size > 1:
                # Equivalent MLA replicas share one object per DCP/CP shard.
                # Keep PP last for cross-stage queries in _batch_exist().
                self.mla_suffix = (
                    f"dcp{storage_config.dcp_rank}_cp{self.attn_cp_rank}"
                    + (f"_{self.pp_rank}" if self.enable_pp else "")
                )

            self.storage_config = storage_config
            self.should_split_heads = storage_config.should_split_heads
            self.split_factor = 0
            if self.should_split_heads:
                self.split_factor = (
                    self.storage_config.tp_lcm_size // self.storage_config.tp_size
                )
                base_rank = self.local_rank * self.split_factor
                target_ranks = [base_rank + i for i in range(self.split_factor)]
                if self.enable_pp:
                    self.mha_suffix = [
                        f"{rank}_{self.pp_rank}" for rank in target_ranks
                    ]
                else:
                    self.mha_suffix = [f"{rank}" for rank in target_ranks]

            self.registered_pools = {}

            self.gb_per_page = None
            self.prefetch_pgs = []
            self.backup_pgs = []
            self.prefetch_bandwidth = []
            self.backup_bandwidth = []

        except ValueError as e:
            logger.error("Configuration loading failed: %s", e)
            raise
        except Exception as exc:
            logger.error("An error occurred while loading the configuration: %s", exc)
            raise

    @staticmethod
    def _iter_host_pool_buffers(host_pool: HostKVCache):
        get_buffers = getattr(
            host_pool,
            "get_hybrid_pool_buffer",
            lambda: [getattr(host_pool, "kv_buffer", None)],
        )
        for buf in get_buffers():
            if buf is not None:
                yield buf

    def check_server(self):
        master_server_ip = self.config.master_server_address.split(":")[0]
        segments_url = f"http://{master_server_ip}:{self.config.master_metrics_port}/get_all_segments"
        start_time = time.perf_counter()

        check_result = False
        while time.perf_counter() - start_time < SETUP_TIMEOUT:
            try:
                check_segments_resp = requests.get(segments_url, timeout=3)
            except Exception:
                logger.info(
                    "waiting mooncake store server started, cost_time: %.2f seconds.",
                    time.perf_counter() - start_time,
                )
                time.sleep(3)
                continue

            if check_segments_resp.text == "":
                logger.info(
                    "waiting mooncake store server started, cost_time: %.2f seconds.",
                    time.perf_counter() - start_time,
                )
                time.sleep(3)
                continue

            logger.info("Mooncake store server started successfully.")
            check_result = True
            break

        if not check_result:
            logger.error("Launch mooncake store server timeout")
            raise ValueError("Launch mooncake store server timeout")

    def warmup(self):
        warmup_key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        warmup_value = bytes(4 * 1024)  # 4 KB

        # Retry logic to handle Transfer Engine startup race condition
        max_retries = 10
        retry_delay = 1.0  # seconds

        for attempt in range(max_retries):
            ret = self.store.put(warmup_key, warmup_value)
            if ret == 0:
                break
            logger.warning(
                f"[TP{self.local_rank}] Warmup put failed (attempt {attempt + 1}/{max_retries}), "
                f"ret={ret}, retrying in {retry_delay}s..."
            )
            time.sleep(retry_delay)
        else:
            raise RuntimeError(
                f"[TP{self.local_rank}] Warmup put failed after {max_retries} attempts, "
                "Transfer Engine might not be ready"
            )

        assert self.store.is_exist(warmup_key) == 1
        assert self.store.get(warmup_key) == warmup_value

    def register_mem_pool_host(self, mem_pool_host: HostKVCache):
        super().register_mem_pool_host(mem_pool_host)
        if getattr(self.mem_pool_host, "kv_buffer", None) is None:
            # Hybrid logical anchors only own allocation indices. Their physical
            # tensors are registered through register_mem_host_pool_v2().
            return
        try:
            for buffer in self._iter_host_pool_buffers(self.mem_pool_host):
                super().register_buffer(buffer)
        except TypeError as err:
            logger.error("Failed to register buffer to Mooncake Store: %s", err)
            raise TypeError("Mooncake Store Register Buffer Error.") from err

        bytes_per_page = mem_pool_host.get_ksize_per_token() * mem_pool_host.page_size
        self.gb_per_page = bytes_per_page / (1 << 30)

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name):
        # KV anchor memory is already registered via register_mem_pool_host().
        # v2 here only registers additional hybrid pools.
        if host_pool_name == PoolName.KV:
            return
        if host_pool_name == PoolName.DRAFT:
            self.registered_pools[host_pool_name] = host_pool
            super().register_buffer(host_pool.kv_buffer)
            return

        # Keep a name->pool mapping so batch v2 can resolve PoolTransfer.name to
        # the corresponding host pool implementation at runtime.
        self.registered_pools[host_pool_name] = host_pool

        # Non-anchor pools are either sidecar-specific pools with their own
        # accessor, or ordinary KV-like host pools used as SWA side pools.
        for buf in self._iter_host_pool_buffers(host_pool):
            super().register_buffer(buf)

    def _tag_keys(self, keys: List[str]) -> List[str]:
        if self.config_prefix is None:
            return keys
        return [f"{self.config_prefix}_{key}" for key in keys]

    def _can_use_group_semantics(self) -> bool:
        return self._use_group_semantics

    def _make_group_id(self, logical_key: str) -> str:
        return f"sglang-hicache:{logical_key}"

    def _expand_group_ids(
        self, logical_keys: List[str], key_multiplier: int
    ) -> List[str]:
        group_ids = []
        for key in logical_keys:
            group_ids.extend([self._make_group_id(key)] * key_multiplier)
        return group_ids

    def _filter_group_ids(
        self, group_ids: Optional[List[str]], indices: List[int]
    ) -> Optional[List[str]]:
        if group_ids is None:
            return None
        return [group_ids[i] for i in indices]

    def describe_l3_object_layout(
        self,
        *,
        sidecar_pool_specs: Sequence[SidecarPoolSpec],
        swa_trailing_pages: Optional[int],
        page_size: int,
    ) -> dict:
        """Describe physical objects using the same key builders as writes.

        Args:
            sidecar_pool_specs: Sidecar hit policies and their index-source pools.
            swa_trailing_pages: The SWA component's full_window_pages, or None
                when no SWA component exists. Mamba uses one trailing page.
            page_size: Resolved engine page size in tokens.

        Returns:
            The availability envelope with backend, page_size and
            hicache_object_layout (pools, key prefix and parallelism metadata).
            Unsupported rank-sharded layouts return enabled=False with a reason.
        """
        from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

        pools = []
        layout = {
            "enabled": True,
            "backend": "mooncake",
            "page_size": page_size,
            "hicache_object_layout": {
                "pools": pools,
                # _tag_keys() prepends this to every object key.
                "key_prefix": self.config_prefix,
                "is_mla_backend": self.is_mla_backend,
                "pp_rank": self.pp_rank,
                "pp_size": self.pp_size,
            },
        }
        # MHA keys embed the tp rank, which one scheduler cannot enumerate. MLA keys
        # only embed the pp stage; merge_l3_layouts joins the stages.
        if not self.is_mla_backend:
            layout.update(
                enabled=False,
                reason="External L3 lookup requires rank-replicated/MLA pools",
            )
            return layout

        if self.mem_pool_host.kv_buffer is not None:
            suffixes, _, _ = self._batch_preprocess(
                [""],
                torch.arange(
                    self.mem_pool_host.page_size, dtype=torch.int64, device="cpu"
                ),
            )
            pools.append(
                {
                    "pool": str(PoolName.KV),
                    "suffixes": suffixes,
                    "hit_policy": "all_pages",
                }
            )

        specs = {spec.pool_name: spec for spec in sidecar_pool_specs}
        trailing_pages = {PoolName.MAMBA: 1, PoolName.SWA: swa_trailing_pages}
        for pool_name in self.registered_pools:
            if pool_name == PoolName.KV:
                continue
            spec = specs.get(pool_name)
            policy = (
                spec.hit_policy
                if spec is not None
                else (
                    PoolHitPolicy.TRAILING_PAGES
                    if pool_name in trailing_pages
                    else PoolHitPolicy.ALL_PAGES
                )
            )
            suffixes, _ = self._get_hybrid_page_component_keys(
                [""], PoolTransfer(name=pool_name)
            )
            entry = {
                "pool": str(pool_name),
                "suffixes": suffixes,
                "hit_policy": policy.value,
            }
            if policy == PoolHitPolicy.TRAILING_PAGES:
                source = spec.indices_from_pool if spec is not None else pool_name
                window = trailing_pages.get(source)
                if window is None or window <= 0:
                    return disabled_l3_layout(
                        f"Unknown or non-positive trailing-page window for pool {pool_name}",
                        backend="mooncake",
                        page_size=page_size,
                    )
                entry["trailing_pages"] = window
            pools.append(entry)
        draft_pool = self.registered_pools.get(PoolName.DRAFT)
        draft_swa_pool = self.registered_pools.get(PoolName.DRAFT_SWA)
        # These auxiliary pools use TP-rank suffixes even with an MLA primary.
        if (
            PoolName.MAMBA in self.registered_pools
            or (
                draft_pool is not None
                and not isinstance(draft_pool, MLATokenToKVPoolHost)
            )
            or (
                draft_swa_pool is not None
                and not isinstance(
                    draft_swa_pool, (DeepSeekV4PagedHostPool, MLATokenToKVPoolHost)
                )
            )
        ):
            layout.update(
                enabled=False,
                reason="Auxiliary L3 pools are not rank-replicated/MLA",
            )
        elif not pools:
            layout.update(enabled=False, reason="No physical L3 pools are registered")
        return layout

    def _get_hybrid_page_component_keys(
        self, page_keys: List[str], transfer: PoolTransfer
    ) -> Tuple[List[str], int]:
        host_pool = getattr(self, "registered_pools", {}).get(transfer.name)
        if host_pool is None:
            raise ValueError(f"Unregistered Mooncake hybrid pool: {transfer.name}")

        if isinstance(host_pool, DevicePoolEntry):
            # A direct-linker entry packs every buffer of a page into one object.
            object_name = "k" if transfer.name == PoolName.KV else transfer.name
            suffix = f"_{self.mla_suffix}_{object_name}"
            return [f"{page_key}{suffix}" for page_key in page_keys], 1

        # Suffix order must match get_page_buffer_meta() for one page, because
        # Mooncake zips object keys with registered buffer pointers.
        pool_name = transfer.name
        suffixes = []
        if pool_name == PoolName.KV:
            suffixes = [f"_{self.mla_suffix}_k"]
        elif pool_name == PoolName.MAMBA:
            # Mamba stores one temporal object plus one object per conv state.
            # conv-only models have no ssm state; drop the 0-element temporal
            # object (mooncake rejects 0-size puts). get_page_buffer_meta drops
            # its temporal pointer under the same condition to stay aligned.
            conv_num = len(getattr(host_pool, "conv_buffer", None) or [])
            suffixes = [f"_{self.mha_suffix}_conv_{i}" for i in range(conv_num)]
            if getattr(host_pool, "temporal_state_elem_size", 1) > 0:
                suffixes = [f"_{self.mha_suffix}_temporal"] + suffixes
        elif pool_name == PoolName.DRAFT:
            # Draft pool's MLA/MHA layout is independent from the target
            # (e.g. EAGLE-MHA draft on top of an MLA target), so pick the
            # suffix scheme from the draft pool's own class. The `_draft`
            # tag is what keeps these keys from colliding with target's
            # `{rank}_k` / `{rank}_k` + `{rank}_v` keys.
            draft_pool = self.registered_pools.get(PoolName.DRAFT)
            if isinstance(draft_pool, MLATokenToKVPoolHost):
                suffixes = [f"_{self.mla_suffix}_{PoolName.DRAFT}_k"]
            else:
                suffixes = [
                    f"_{self.mha_suffix}_{PoolName.DRAFT}_k",
                    f"_{self.mha_suffix}_{PoolName.DRAFT}_v",
                ]
        elif pool_name == PoolName.DRAFT_SWA:
            from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

            if isinstance(
                host_pool,
                (DeepSeekV4PagedHostPool, MLATokenToKVPoolHost),
            ):
                suffixes = [f"_{self.mla_suffix}_{pool_name}"]
            elif isinstance(host_pool, MHATokenToKVPoolHost):
                suffixes = [
                    f"_{self.mha_suffix}_{pool_name}_k",
                    f"_{self.mha_suffix}_{pool_name}_v",
                ]
        elif pool_name in (
            PoolName.INDEXER,
            PoolName.DRAFT_INDEXER,
            PoolName.DEEPSEEK_V4_C1,
            PoolName.DEEPSEEK_V4_C1_INDEXER,
            PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE,
            PoolName.DEEPSEEK_V4_C2,
            PoolName.DEEPSEEK_V4_C2_INDEXER,
            PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE,
            PoolName.DEEPSEEK_V4_C4,
            PoolName.DEEPSEEK_V4_C4_ROPE,
            PoolName.DEEPSEEK_V4_C4_INDEXER,
            PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE,
            PoolName.DEEPSEEK_V4_C128,
            PoolName.DEEPSEEK_V4_C128_ROPE,
            PoolName.DEEPSEEK_V4_C4_STATE,
            PoolName.DEEPSEEK_V4_C4_INDEXER_STATE,
            PoolName.DEEPSEEK_V4_C128_STATE,
        ):
            # DSA indexer and DeepSeek V4 side pools are page-packed
            # single-object pools.
            suffixes = [f"_{self.mla_suffix}_{pool_name}"]
        elif pool_name == PoolName.SWA:
            if not self.is_mla_backend and hasattr(host_pool, "v_buffer"):
                # Ordinary MHA SWA mirrors a K/V pool.
                suffixes = [
                    f"_{self.mha_suffix}_{pool_name}_k",
                    f"_{self.mha_suffix}_{pool_name}_v",
                ]
            elif self.is_mla_backend:
                suffixes = [f"_{self.mla_suffix}_{pool_name}"]

        if not suffixes:
            raise ValueError(
                f"Unsupported Mooncake hybrid pool name: {pool_name}, "
                f"host_pool={type(host_pool)}"
            )
        key_multiplier = len(suffixes)
        component_keys = [
            f"{page_key}{suffix}" for page_key in page_keys for suffix in suffixes
        ]
        return component_keys, key_multiplier

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        if self.mem_pool_host.kv_buffer is None:
            # Logical anchor: no physical KV object exists in Mooncake, so the
            # usable prefix is determined entirely by required sidecar objects.
            kv_pages = len(keys)
        else:
            kv_pages = self.batch_exists(keys, extra_info)

        hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        # Start from every KV prefix and let each pool remove the stop points it
        # cannot serve. Collect the whole set, not just its maximum: a
        # TRAILING_PAGES pool leaves holes (see PoolTransferResult), and the
        # caller has to intersect these sets across ranks.
        restorable = list(range(1, kv_pages + 1))

        if not restorable:
            return PoolTransferResult(0, hit_count, [])

        prepared = []
        all_component_keys = []
        for transfer in pool_transfers or []:
            component_keys, key_multiplier = self._get_hybrid_page_component_keys(
                keys, transfer
            )
            component_keys = self._tag_keys(component_keys)
            start = len(all_component_keys)
            all_component_keys.extend(component_keys)
            prepared.append((transfer, key_multiplier, start, len(all_component_keys)))

        all_exists = self._batch_exist(all_component_keys) if all_component_keys else []
        for transfer, key_multiplier, start, end in prepared:
            if not restorable:
                break
            ex = all_exists[start:end]
            if key_multiplier > 0:
                page_exists = [
                    all(
                        r == 1
                        for r in ex[i * key_multiplier : (i + 1) * key_multiplier]
                    )
                    for i in range(kv_pages)
                ]
            else:
                page_exists = [False] * kv_pages
            boundary = 0
            pool_restorable = []
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                try:
                    boundary = page_exists.index(False)
                except ValueError:
                    boundary = kv_pages
                pool_restorable = list(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                # A stop point works when the window ending there is complete,
                # so scan every one instead of stopping at the longest.
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                for prefix_len in range(kv_pages, 0, -1):
                    if all(
                        page_exists[i]
                        for i in range(max(0, prefix_len - trailing), prefix_len)
                    ):
                        pool_restorable.append(prefix_len)
                        if boundary == 0:
                            boundary = prefix_len
            else:
                raise ValueError(f"Unsupported pool hit policy: {transfer.hit_policy}")
            if boundary:
                hit_count[transfer.name] = boundary
            pool_restorable_set = set(pool_restorable)
            restorable = [p for p in restorable if p in pool_restorable_set]

        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hit_count, restorable)

    def _batch_io_v2(
        self,
        transfers: List[PoolTransfer],
        is_set: bool,
        session_id: Optional[str] = None,
    ):
        # Expand every pool first so one logical operation becomes one Mooncake
        # RPC rather than one RPC per hybrid-cache component.
        prepared = []
        all_key_strs = []
        all_ptrs = []
        all_sizes = []
        all_group_ids = []
        buffer_requests = []
        for transfer in transfers:
            host_pool = self.registered_pools.get(transfer.name)
            keys = transfer.keys
            if host_pool is None:
                raise ValueError(f"Unregistered Mooncake hybrid pool: {transfer.name}")
            page_size = host_pool.page_size or 1
            host_indices = transfer.host_indices
            assert len(keys) > 0
            assert len(keys) == len(host_indices) // page_size

            tagged_keys = self._tag_keys(keys)
            key_strs, key_multiplier = self._get_hybrid_page_component_keys(
                keys, transfer
            )
            key_strs = self._tag_keys(key_strs)
            start = len(all_key_strs)
            all_key_strs.extend(key_strs)
            buffer_requests.append(
                (host_pool, host_indices, key_strs, key_multiplier, start)
            )
            if is_set and self._can_use_group_semantics():
                all_group_ids.extend(
                    self._expand_group_ids(tagged_keys, key_multiplier)
                )
            prepared.append((transfer.name, key_multiplier, start, len(all_key_strs)))

        if not prepared:
            return {}

        exist_result = self._batch_exist(all_key_strs) if is_set else None
        for host_pool, host_indices, key_strs, key_multiplier, start in buffer_requests:
            pool_ptrs, pool_sizes = self._build_pool_buffer_meta(
                host_pool=host_pool,
                host_indices=host_indices,
                key_strs=key_strs,
                key_multiplier=key_multiplier,
                exist_states=(
                    exist_result[start : start + len(key_strs)]
                    if exist_result is not None
                    else None
                ),
            )
            all_ptrs.extend(pool_ptrs)
            all_sizes.extend(pool_sizes)

        if any(isinstance(ptr, Sequence) for ptr in all_ptrs):
            all_ptrs = [
                list(ptr) if isinstance(ptr, Sequence) else [ptr] for ptr in all_ptrs
            ]
            all_sizes = [
                list(size) if isinstance(size, Sequence) else [size]
                for size in all_sizes
            ]

        if is_set:
            assert exist_result is not None
            io_results = [0 if state == 1 else -1 for state in exist_result]
            missing_idx = [i for i, state in enumerate(exist_result) if state != 1]
            if missing_idx:
                put_results = self._put_batch_zero_copy_impl(
                    [all_key_strs[i] for i in missing_idx],
                    [all_ptrs[i] for i in missing_idx],
                    [all_sizes[i] for i in missing_idx],
                    self._filter_group_ids(
                        all_group_ids if all_group_ids else None, missing_idx
                    ),
                    session_ids=(
                        [session_id] * len(missing_idx)
                        if session_id and self._supports_session_ids
                        else None
                    ),
                )
                for i, res in zip(missing_idx, put_results):
                    io_results[i] = res
        else:
            io_results = self._get_batch_zero_copy_impl(
                all_key_strs, all_ptrs, all_sizes
            )

        results: dict = {}
        for name, key_multiplier, start, end in prepared:
            results[name] = self._batch_postprocess(
                io_results[start:end],
                is_set_operate=is_set,
                key_multiplier=key_multiplier,
            )
        return results

    def _build_pool_buffer_meta(
        self,
        host_pool: HostKVCache,
        host_indices: torch.Tensor,
        key_strs: List[str],
        key_multiplier: int,
        exist_states: Optional[List[int]],
    ) -> Tuple[List[Any], List[Any]]:
        # Only pages the store is missing need per-layer addresses. Zero
        # placeholders keep result and group offsets aligned for the rest.
        object_indices = list(range(len(key_strs)))
        if exist_states is not None:
            missing_pages = [
                page
                for page in range(len(key_strs) // key_multiplier)
                if any(
                    state != 1
                    for state in exist_states[
                        page * key_multiplier : (page + 1) * key_multiplier
                    ]
                )
            ]
            if not missing_pages:
                return [0] * len(key_strs), [0] * len(key_strs)
            if len(missing_pages) * key_multiplier < len(key_strs):
                # Metadata generation consumes CPU indices anyway, so select
                # the logical pages there rather than uploading a new index.
                page_size = host_pool.page_size or 1
                host_indices = host_indices.detach().to(device="cpu")
                host_indices = host_indices.reshape(-1, page_size)[
                    missing_pages
                ].reshape(-1)
                object_indices = [
                    page * key_multiplier + component
                    for page in missing_pages
                    for component in range(key_multiplier)
                ]

        selected_keys = [key_strs[i] for i in object_indices]
        ptr_list, element_size_list = host_pool.get_page_buffer_meta(host_indices)
        if len(ptr_list) != len(selected_keys):
            ptr_list, element_size_list = self._pack_multi_buffer_meta(
                selected_keys, ptr_list, element_size_list
            )
        pool_ptrs = [0] * len(key_strs)
        pool_sizes = [0] * len(key_strs)
        for index, ptr, size in zip(object_indices, ptr_list, element_size_list):
            pool_ptrs[index] = ptr
            pool_sizes[index] = size
        return pool_ptrs, pool_sizes

    def batch_get_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict:
        return self._batch_io_v2(transfers, is_set=False)

    def batch_set_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict:
        # ``extra_info.extra_info["session_id"]`` names the session that wrote the
        # pages; Mooncake publishes it on the stored KV events.
        session_id = (
            (extra_info.extra_info or {}).get("session_id") if extra_info else None
        )
        return self._batch_io_v2(transfers, is_set=True, session_id=session_id)

    def _get_mha_split_heads_buffer_meta(self, keys, indices):
        ptr_list, element_size_list = (
            self.mem_pool_host.get_split_heads_page_buffer_meta(
                indices, self.split_factor
            )
        )
        key_list = []
        for key_ in keys:
            for suffix in self.mha_suffix:
                key_list.append(f"{key_}_{suffix}_k")
                key_list.append(f"{key_}_{suffix}_v")
        assert len(key_list) == len(ptr_list)
        return key_list, ptr_list, element_size_list

    @staticmethod
    def _uses_multi_buffer(buffer_ptrs: List[Any]) -> bool:
        return bool(buffer_ptrs) and isinstance(buffer_ptrs[0], Sequence)

    @staticmethod
    def _pack_multi_buffer_meta(
        key_strs: List[str],
        ptr_list: List[int],
        element_size_list: List[int],
    ) -> Tuple[List[Any], List[Any]]:
        if len(ptr_list) == len(key_strs):
            return ptr_list, element_size_list

        assert len(key_strs) > 0
        assert len(ptr_list) == len(element_size_list)
        assert len(ptr_list) % len(key_strs) == 0

        nbuf = len(ptr_list) // len(key_strs)
        return [ptr_list[i : i + nbuf] for i in range(0, len(ptr_list), nbuf)], [
            element_size_list[i : i + nbuf]
            for i in range(0, len(element_size_list), nbuf)
        ]

    def _get_mha_buffer_meta(self, keys, indices):
        ptr_list, element_size_list = self.mem_pool_host.get_page_buffer_meta(indices)
        key_list = []
        for key_ in keys:
            key_list.append(f"{key_}_{self.mha_suffix}_k")
            key_list.append(f"{key_}_{self.mha_suffix}_v")
        if len(key_list) != len(ptr_list):
            raise RuntimeError(
                "Mooncake layer_first multi-buffer is only supported for MLA "
                "host KV pool. Use page_first/page_first_direct for MHA."
            )
        return key_list, ptr_list, element_size_list

    def _get_mla_buffer_meta(self, keys, indices):
        ptr_list, element_size_list = self.mem_pool_host.get_page_buffer_meta(indices)
        key_list = []
        for key_ in keys:
            key_list.append(f"{key_}_{self.mla_suffix}_k")
        ptr_list, element_size_list = self._pack_multi_buffer_meta(
            key_list, ptr_list, element_size_list
        )
        assert len(key_list) == len(ptr_list)
        return key_list, ptr_list, element_size_list

    def _batch_preprocess(self, keys, host_indices):
        assert len(keys) > 0
        page_size = (
            self.storage_config.logical_page_size
            if self.dcp_size > 1
            else self.mem_pool_host.page_size
        )
        assert len(keys) == len(host_indices) // page_size
        if self.is_mla_backend:
            return self._get_mla_buffer_meta(keys, host_indices)
        else:
            if self.should_split_heads:
                return self._get_mha_split_heads_buffer_meta(keys, host_indices)
            else:
                return self._get_mha_buffer_meta(keys, host_indices)

    def _batch_postprocess(
        self, results: List[int], is_set_operate=False, key_multiplier=None
    ):
        """
        refer to https://github.com/kvcache-ai/Mooncake/blob/main/mooncake-store/include/pybind_client.h
        for batch_get_into, results is Vector of integers,
            where each element is the number of bytes read on success, or a negative value on error
        for batch_put_from, results is Vector of integers,
            where each element is 0 on success, or a negative value on error
        """
        if key_multiplier is None:
            if self.is_mla_backend:
                key_multiplier = 1
            else:
                key_multiplier = 2
                if self.should_split_heads:
                    key_multiplier *= self.split_factor

        result_groups = [
            results[i : i + key_multiplier]
            for i in range(0, len(results), key_multiplier)
        ]
        return [
            (
                all(res == 0 for res in group)
                if is_set_operate
                else all(res > 0 for res in group)
            )
            for group in result_groups
        ]

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if self.mem_pool_host.kv_buffer is None:
            # DeepSeek V4's KV anchor is logical only; v2 side pools carry data.
            return [True] * len(keys)

        # Apply config prefix if available.
        keys = self._tag_keys(keys)

        key_strs, buffer_ptrs, buffer_sizes = self._batch_preprocess(keys, host_indices)

        start_time = time.perf_counter()
        get_results = self._get_batch_zero_copy_impl(
            key_strs, buffer_ptrs, buffer_sizes
        )
        end_time = time.perf_counter()

        if self.enable_storage_metrics:
            self.prefetch_pgs.append(len(keys))
            self.prefetch_bandwidth.append(
                len(keys) / (end_time - start_time) * self.gb_per_page
            )

        return self._batch_postprocess(get_results, is_set_operate=False)

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if self.mem_pool_host.kv_buffer is None:
            # DeepSeek V4's KV anchor is logical only; v2 side pools carry data.
            return [True] * len(keys)

        # Apply config prefix if available.
        keys = self._tag_keys(keys)

        key_strs, buffer_ptrs, buffer_sizes = self._batch_preprocess(keys, host_indices)
        key_multiplier = len(key_strs) // len(keys)
        group_ids = (
            self._expand_group_ids(keys, key_multiplier)
            if self._can_use_group_semantics()
            else None
        )
        exist_result = self._batch_exist(key_strs)

        set_keys = []
        set_buffer_ptrs = []
        set_buffer_sizes = []
        set_indices = []
        set_results = [-1] * len(key_strs)
        for i in range(len(key_strs)):
            if exist_result[i] != 1:
                set_keys.append(key_strs[i])
                set_buffer_ptrs.append(buffer_ptrs[i])
                set_buffer_sizes.append(buffer_sizes[i])
                set_indices.append(i)
            else:
                set_results[i] = 0

        # Only set non-existing keys to storage
        if len(set_keys) > 0:
            start_time = time.perf_counter()
            put_results = self._put_batch_zero_copy_impl(
                set_keys,
                set_buffer_ptrs,
                set_buffer_sizes,
                self._filter_group_ids(group_ids, set_indices),
            )
            end_time = time.perf_counter()

            if self.enable_storage_metrics:
                self.backup_pgs.append(len(set_keys))
                self.backup_bandwidth.append(
                    len(set_keys) / (end_time - start_time) * self.gb_per_page
                )

            for i in range(len(set_indices)):
                set_results[set_indices[i]] = put_results[i]

        return self._batch_postprocess(set_results, is_set_operate=True)

    def set(
        self,
        key,
        value: Optional[Any] = None,
        target_location: Optional[List[int]] = None,
        target_sizes: Optional[List[int]] = None,
    ) -> bool:
        # Only support zero copy set for now
        assert target_location is not None and target_sizes is not None
        exist_result = self._batch_exist([key])
        if exist_result[0] == 1:
            return True
        put_result = self._put_batch_zero_copy_impl(
            [key], [target_location], [target_sizes]
        )
        return put_result[0] == 0

    def batch_set(
        self,
        keys: List[str],
        values: Optional[List[torch.Tensor]] = None,
        target_locations: Optional[List[int]] = None,
        target_sizes: Optional[List[int]] = None,
    ) -> bool:
        # Only support zero copy set for now
        assert target_locations is not None and target_sizes is not None
        assert len(keys) == len(target_locations) == len(target_sizes)

        if len(keys) == 0:
            return False

        for i in range(len(keys)):
            if (
                keys[i] is None
                or target_locations[i] is None
                or target_sizes[i] is None
            ):
                return False

        exist_result = self._batch_exist(keys)
        set_keys = []
        set_target_locations = []
        set_target_sizes = []
        set_indices = []
        for i in range(len(keys)):
            if exist_result[i] != 1:
                set_keys.append(keys[i])
                set_target_locations.append(target_locations[i])
                set_target_sizes.append(target_sizes[i])
                set_indices.append(i)
        # Only set non-existing keys to storage
        start_time = time.perf_counter()
        put_result = self._put_batch_zero_copy_impl(
            set_keys, set_target_locations, set_target_sizes
        )
        end_time = time.perf_counter()

        if self.enable_storage_metrics:
            self.backup_pgs.append(len(set_keys))
            self.backup_bandwidth.append(
                len(set_keys) / (end_time - start_time) * self.gb_per_page
            )

        for i in range(len(set_indices)):
            if put_result[i] == 0:
                exist_result[set_indices[i]] = 1

        success_count = 0
        for i in range(len(keys)):
            if exist_result[i] == 0:
                break
            success_count += 1
        # TODO: return the number of consecutive successful operations from the start.
        return success_count == len(keys)

    def get(
        self,
        key,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        assert target_location is not None and target_sizes is not None
        get_result = self._get_batch_zero_copy_impl(
            [key], [target_location], [target_sizes]
        )
        return get_result[0] >= 0

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> int:
        assert len(keys) == len(target_locations) == len(target_sizes)
        if len(keys) == 0:
            return 0

        start_time = time.perf_counter()
        get_result = self._get_batch_zero_copy_impl(
            keys, target_locations, target_sizes
        )
        end_time = time.perf_counter()

        if self.is_mla_backend:
            key_multiplier = 1
        else:
            key_multiplier = 2

        if self.enable_storage_metrics:
            self.prefetch_pgs.append(len(keys))
            self.prefetch_bandwidth.append(
                len(keys) / (end_time - start_time) * self.gb_per_page
            )

        for i in range(len(keys)):
            if get_result[i] < 0:
                return i // key_multiplier
        return len(keys) // key_multiplier

    def exists(self, key) -> bool:
        exist_result = self._batch_exist([key])
        return exist_result[0] == 1

    def batch_exists(
        self, keys, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        # Apply config prefix if available.
        keys = self._tag_keys(keys)

        if self.is_mla_backend:
            query_keys = [f"{key}_{self.mla_suffix}_k" for key in keys]
            key_multiplier = 1
        else:
            query_keys = []
            if self.should_split_heads:
                for key in keys:
                    for suffix in self.mha_suffix:
                        query_keys.append(f"{key}_{suffix}_k")
                        query_keys.append(f"{key}_{suffix}_v")
                key_multiplier = 2 * self.split_factor
            else:
                for key in keys:
                    query_keys.append(f"{key}_{self.mha_suffix}_k")
                    query_keys.append(f"{key}_{self.mha_suffix}_v")
                key_multiplier = 2

        exist_result = self._batch_exist(query_keys)
        for i in range(len(query_keys)):
            if exist_result[i] != 1:
                return i // key_multiplier
        return len(query_keys) // key_multiplier

    def close(self):
        # MooncakeDistributedStore will automatically call the destructor, so
        # it is unnecessary to close it manually.
        pass

    def clear(self) -> None:
        self.store.remove_all()

    def _put_batch_zero_copy_impl(
        self,
        key_strs: List[str],
        buffer_ptrs: List[Any],
        buffer_sizes: List[Any],
        group_ids: Optional[List[str]] = None,
        session_ids: Optional[List[str]] = None,
    ) -> List[int]:
        config = None
        if self._can_use_group_semantics() and group_ids is not None:
            if len(group_ids) != len(key_strs):
                raise ValueError(
                    "Mooncake group_ids length must match key_strs length: "
                    f"{len(group_ids)} != {len(key_strs)}"
                )
            config = self._replicate_config_cls()
            config.group_ids = group_ids
        if session_ids is not None:
            config = config or self._replicate_config_cls()
            config.session_ids = session_ids

        if self._uses_multi_buffer(buffer_ptrs):
            config = config or self._replicate_config_cls()
            return self.store.batch_put_from_multi_buffers(
                key_strs, buffer_ptrs, buffer_sizes, config
            )
        elif config is not None:
            return self.store.batch_put_from(
                key_strs, buffer_ptrs, buffer_sizes, config
            )
        else:
            return self.store.batch_put_from(key_strs, buffer_ptrs, buffer_sizes)

    def _get_batch_zero_copy_impl(
        self, key_strs: List[str], buffer_ptrs: List[Any], buffer_sizes: List[Any]
    ) -> List[int]:
        if self._uses_multi_buffer(buffer_ptrs):
            return self.store.batch_get_into_multi_buffers(
                key_strs, buffer_ptrs, buffer_sizes
            )
        return self.store.batch_get_into(key_strs, buffer_ptrs, buffer_sizes)

    def _batch_exist(self, key_strs: List[str]) -> List[int]:
        return self.store.batch_is_exist(key_strs)

    def get_stats(self):
        storage_metrics = StorageMetrics()
        storage_metrics.prefetch_pgs.extend(self.prefetch_pgs)
        storage_metrics.backup_pgs.extend(self.backup_pgs)
        storage_metrics.prefetch_bandwidth.extend(self.prefetch_bandwidth)
        storage_metrics.backup_bandwidth.extend(self.backup_bandwidth)
        self.prefetch_pgs.clear()
        self.backup_pgs.clear()
        self.prefetch_bandwidth.clear()
        self.backup_bandwidth.clear()
        return storage_metrics
