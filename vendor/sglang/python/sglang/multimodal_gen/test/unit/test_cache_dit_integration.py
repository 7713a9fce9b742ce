import importlib
import importlib.util
import subprocess
import sys
import types
import unittest
from pathlib import Path
from unittest.mock import Mock, patch


class _FakeDBCacheConfig:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def reset(self, **kwargs):
        return kwargs


class _FakeForwardPattern:
    # A class (not a SimpleNamespace instance) so it is a valid type in
    # annotations like List[ForwardPattern], matching the real Enum.
    Pattern_0 = "Pattern_0"
    Pattern_2 = "Pattern_2"
    Pattern_3 = "Pattern_3"


class _FakeTaylorSeerCalibratorConfig:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _install_cache_dit_stub():
    cache_dit = types.ModuleType("cache_dit")
    cache_dit.enable_calls = []
    cache_dit.disable_calls = []
    cache_dit.refresh_calls = []
    cache_dit.steps_mask_calls = []

    def enable_cache(target, **kwargs):
        cache_dit.enable_calls.append({"target": target, **kwargs})

    def disable_cache(target):
        cache_dit.disable_calls.append(target)

    def refresh_context(transformer, cache_config, verbose=False):
        cache_dit.refresh_calls.append(
            {
                "transformer": transformer,
                "cache_config": cache_config,
                "verbose": verbose,
            }
        )

    def steps_mask(*, mask_policy, total_steps):
        cache_dit.steps_mask_calls.append(
            {"mask_policy": mask_policy, "total_steps": total_steps}
        )
        return [1] * total_steps

    cache_dit.enable_cache = enable_cache
    cache_dit.disable_cache = disable_cache
    cache_dit.refresh_context = refresh_context
    cache_dit.steps_mask = steps_mask
    cache_dit.BlockAdapter = types.SimpleNamespace
    cache_dit.DBCacheConfig = _FakeDBCacheConfig
    cache_dit.ForwardPattern = _FakeForwardPattern
    cache_dit.ParamsModifier = object
    # Not bare `object`: enable paths construct it with kwargs
    # (TaylorSeerCalibratorConfig(taylorseer_order=...)) to fill the
    # calibrator slot, and tests assert on the constructed instance.
    cache_dit.TaylorSeerCalibratorConfig = _FakeTaylorSeerCalibratorConfig

    block_adapters = types.ModuleType("cache_dit.caching.block_adapters")

    class _FakeBlockAdapterRegister:
        supported = True

        @classmethod
        def is_supported(cls, _transformer):
            return cls.supported

    block_adapters.BlockAdapterRegister = _FakeBlockAdapterRegister
    cache_dit.BlockAdapterRegister = _FakeBlockAdapterRegister

    class _FakeDMDCalibratorConfig:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    cache_dit.DMDCalibratorConfig = _FakeDMDCalibratorConfig

    parallelism = types.ModuleType("cache_dit.parallelism")
    parallelism.ParallelismBackend = object
    parallelism.ParallelismConfig = object
    cache_dit.ParallelismBackend = parallelism.ParallelismBackend
    cache_dit.ParallelismConfig = parallelism.ParallelismConfig

    return {
        "cache_dit": cache_dit,
        "cache_dit.caching.block_adapters": block_adapters,
        "cache_dit.parallelism": parallelism,
    }


def _install_sglang_dependency_stubs():
    sglang = types.ModuleType("sglang")
    multimodal_gen = types.ModuleType("sglang.multimodal_gen")
    runtime = types.ModuleType("sglang.multimodal_gen.runtime")
    distributed = types.ModuleType("sglang.multimodal_gen.runtime.distributed")
    parallel_state = types.ModuleType(
        "sglang.multimodal_gen.runtime.distributed.parallel_state"
    )
    utils = types.ModuleType("sglang.multimodal_gen.runtime.utils")
    logging_utils = types.ModuleType(
        "sglang.multimodal_gen.runtime.utils.logging_utils"
    )

    parallel_state.get_ring_parallel_world_size = lambda: 1
    parallel_state.get_tp_world_size = lambda: 1
    parallel_state.get_ulysses_parallel_world_size = lambda: 1
    parallel_state.get_classifier_free_guidance_world_size = lambda: 1
    parallel_state.get_dit_group = lambda: None

    class _FakeLogger:
        def debug(self, *_args, **_kwargs):
            pass

        def info(self, *_args, **_kwargs):
            pass

    logging_utils.init_logger = lambda _name: _FakeLogger()

    return {
        "sglang": sglang,
        "sglang.multimodal_gen": multimodal_gen,
        "sglang.multimodal_gen.runtime": runtime,
        "sglang.multimodal_gen.runtime.distributed": distributed,
        "sglang.multimodal_gen.runtime.distributed.parallel_state": parallel_state,
        "sglang.multimodal_gen.runtime.utils": utils,
        "sglang.multimodal_gen.runtime.utils.logging_utils": logging_utils,
    }


def _install_torch_stub():
    torch = types.ModuleType("torch")
    torch_nn = types.ModuleType("torch.nn")
    torch_dist = types.ModuleType("torch.distributed")

    class _FakeModule:
        pass

    class _FakeProcessGroup:
        pass

    class _FakeReduceOp:
        AVG = "AVG"

    torch_nn.Module = _FakeModule
    torch_dist.ProcessGroup = _FakeProcessGroup
    torch_dist.ReduceOp = _FakeReduceOp
    torch_dist.is_initialized = lambda: False
    torch.distributed = torch_dist
    torch.nn = torch_nn
    torch.Tensor = object

    return {
        "torch": torch,
        "torch.nn": torch_nn,
        "torch.distributed": torch_dist,
    }


def _import_module_with_stub():
    stub_modules = _install_cache_dit_stub()
    stub_modules.update(_install_sglang_dependency_stubs())
    stub_modules.update(_install_torch_stub())
    module_path = (
        Path(__file__).resolve().parents[2]
        / "runtime"
        / "cache"
        / "cache_dit_integration.py"
    )
    with patch.dict(sys.modules, stub_modules):
        spec = importlib.util.spec_from_file_location(
            "test_cache_dit_integration_target", module_path
        )
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
    return module


def _import_module_with_legacy_stub():
    # Full stub minus the symbols that only became top-level exports in
    # cache-dit 1.5.0: forces cache_dit_integration onto its fallback path.
    # All pre-1.5.0 releases pinned by sglang (1.3.0, 1.3.5) share the same
    # import surface, so "1.3.0" represents every cache-dit < 1.5.0.
    stub_modules = _install_cache_dit_stub()
    stub_modules.update(_install_sglang_dependency_stubs())
    stub_modules.update(_install_torch_stub())
    cache_dit = stub_modules["cache_dit"]
    cache_dit.__version__ = "1.3.0"
    for name in (
        "BlockAdapterRegister",
        "DMDCalibratorConfig",
        "ParallelismBackend",
        "ParallelismConfig",
    ):
        delattr(cache_dit, name)
    module_path = (
        Path(__file__).resolve().parents[2]
        / "runtime"
        / "cache"
        / "cache_dit_integration.py"
    )
    with patch.dict(sys.modules, stub_modules):
        spec = importlib.util.spec_from_file_location(
            "test_cache_dit_integration_legacy_target", module_path
        )
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
    return module, stub_modules


class TestCacheDitSimilarityGroups(unittest.TestCase):
    def test_independent_cfg_or_dp_peers_do_not_reduce_over_world(self):
        for group in (None, "singleton-sp"):
            with self.subTest(group=group):
                module = _import_module_with_stub()
                original = Mock(return_value=True)
                manager_type = type(
                    "CachedContextManager", (), {"similarity": original}
                )
                contexts = types.ModuleType("cache_dit.caching.cache_contexts")
                contexts.cache_manager = types.SimpleNamespace(
                    CachedContextManager=manager_type
                )
                module.dist.get_world_size = Mock(return_value=1)
                with patch.dict(sys.modules, {contexts.__name__: contexts}):
                    module._patch_cache_dit_similarity()
                manager = manager_type()
                manager._sglang_sp_group = group
                manager.similarity(
                    "previous", "current", threshold=0.1, parallelized=True
                )
                self.assertFalse(original.call_args.kwargs["parallelized"])


class TestCacheDitRefreshContext(unittest.TestCase):
    def test_refresh_preserves_explicit_scm_mask_and_policy(self):
        module = _import_module_with_stub()
        module.refresh_context_on_transformer(
            "transformer",
            4,
            scm_preset="fast",
            steps_computation_mask=[1, 0, 1, 0],
            steps_computation_policy="static",
        )
        self.assertEqual(module.cache_dit.steps_mask_calls, [])
        self.assertEqual(
            module.cache_dit.refresh_calls[0]["cache_config"],
            {
                "num_inference_steps": 4,
                "steps_computation_mask": [1, 0, 1, 0],
                "steps_computation_policy": "static",
            },
        )

    def test_refresh_context_without_scm_preset_skips_steps_mask(self):
        module = _import_module_with_stub()
        module.refresh_context_on_transformer(
            transformer="transformer",
            num_inference_steps=50,
            scm_preset=None,
            verbose=True,
        )

        self.assertEqual(module.cache_dit.steps_mask_calls, [])
        self.assertEqual(len(module.cache_dit.refresh_calls), 1)
        self.assertEqual(
            module.cache_dit.refresh_calls[0]["cache_config"],
            {
                "num_inference_steps": 50,
                "steps_computation_mask": None,
                "steps_computation_policy": None,
            },
        )

    def test_refresh_context_with_scm_preset_uses_steps_mask(self):
        module = _import_module_with_stub()
        module.refresh_context_on_transformer(
            transformer="transformer",
            num_inference_steps=8,
            scm_preset="fast",
        )

        self.assertEqual(
            module.cache_dit.steps_mask_calls,
            [{"mask_policy": "fast", "total_steps": 8}],
        )
        self.assertEqual(
            module.cache_dit.refresh_calls[0]["cache_config"],
            {
                "num_inference_steps": 8,
                "steps_computation_mask": [1] * 8,
                "steps_computation_policy": "fast",
            },
        )

    def test_dual_refresh_without_scm_preset_skips_steps_mask(self):
        module = _import_module_with_stub()
        module.refresh_context_on_dual_transformer(
            transformer="transformer",
            transformer_2="transformer_2",
            num_high_noise_steps=12,
            num_low_noise_steps=6,
            scm_preset=None,
        )

        self.assertEqual(module.cache_dit.steps_mask_calls, [])
        self.assertEqual(len(module.cache_dit.refresh_calls), 2)
        self.assertEqual(
            module.cache_dit.refresh_calls[0]["cache_config"],
            {
                "num_inference_steps": 12,
                "steps_computation_mask": None,
                "steps_computation_policy": None,
            },
        )
        self.assertEqual(
            module.cache_dit.refresh_calls[1]["cache_config"],
            {
                "num_inference_steps": 6,
                "steps_computation_mask": None,
                "steps_computation_policy": None,
            },
        )


def _make_transformer(class_name, layers=None):
    transformer = type(class_name, (), {})()
    if layers is not None:
        transformer.layers = layers
    return transformer


class TestBuildCustomBlockAdapter(unittest.TestCase):
    def test_fsdp_subclass_preserves_native_adapter(self):
        module = _import_module_with_stub()
        for name, attr, multimodal, pattern in (
            (
                "Kandinsky6Transformer3DModel",
                "visual_transformer_blocks",
                True,
                "Pattern_0",
            ),
            (
                "Kandinsky6Transformer3DModel",
                "visual_transformer_blocks",
                False,
                "Pattern_2",
            ),
            ("AnimaTransformer3DModel", "transformer_blocks", False, "Pattern_3"),
        ):
            with self.subTest(name=name, multimodal=multimodal):
                blocks = ["block_0", "block_1"]
                native = type(name, (), {attr: blocks})
                fsdp_mixin = type("FSDPModule", (), {})
                transformer = type(f"FSDP{name}", (fsdp_mixin, native), {})()
                transformer.config = types.SimpleNamespace(is_multimodal=multimodal)
                adapter = module._build_custom_block_adapter(
                    transformer, has_separate_cfg=True
                )
                self.assertIs(adapter.transformer, transformer)
                self.assertIs(adapter.blocks, blocks)
                self.assertEqual(adapter.forward_pattern, pattern)
                self.assertTrue(adapter.has_separate_cfg)

    def test_kandinsky6_caches_both_joint_streams(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("Kandinsky6Transformer3DModel")
        transformer.visual_transformer_blocks = ["joint_block"]
        for multimodal, pattern in ((True, "Pattern_0"), (False, "Pattern_2")):
            with self.subTest(multimodal=multimodal):
                transformer.config = types.SimpleNamespace(is_multimodal=multimodal)
                adapter = module._build_custom_block_adapter(
                    transformer, has_separate_cfg=True
                )
                self.assertIs(adapter.blocks, transformer.visual_transformer_blocks)
                self.assertEqual(adapter.forward_pattern, pattern)
                self.assertTrue(adapter.has_separate_cfg)

    def test_builds_adapter_for_registered_class(self):
        module = _import_module_with_stub()
        blocks = ["block_0", "block_1"]
        for class_name, blocks_attr in (
            ("ErnieImageTransformer2DModel", "layers"),
            ("MingImageTransformer2DModel", "layers"),
            ("AnimaTransformer3DModel", "transformer_blocks"),
            ("Flux3ImageDiT", "single_blocks"),
        ):
            with self.subTest(class_name=class_name):
                transformer = type(class_name, (), {blocks_attr: blocks})()
                adapter = module._build_custom_block_adapter(
                    transformer, has_separate_cfg=True
                )

                self.assertIsNotNone(adapter)
                self.assertIs(adapter.transformer, transformer)
                self.assertIs(adapter.blocks, blocks)
                self.assertEqual(adapter.forward_pattern, "Pattern_3")
                self.assertTrue(adapter.has_separate_cfg)

    def test_returns_none_for_unknown_class(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("SomeUnregisteredTransformer", ["b0"])

        self.assertIsNone(module._build_custom_block_adapter(transformer))

    def test_raises_when_blocks_attr_missing(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("ErnieImageTransformer2DModel")

        with self.assertRaises(ValueError):
            module._build_custom_block_adapter(transformer)

    def test_has_separate_cfg_follows_runtime(self):
        # No model pins the mode; has_separate_cfg always follows the run's CFG mode
        # (Krea-2 Raw -> True, Krea-2 Turbo -> False).
        module = _import_module_with_stub()
        blocks = ["block_0", "block_1"]

        transformer_raw = _make_transformer("Krea2Transformer2DModel")
        transformer_raw.transformer_blocks = blocks
        adapter_raw = module._build_custom_block_adapter(
            transformer_raw, has_separate_cfg=True
        )
        self.assertEqual(adapter_raw.blocks, blocks)
        self.assertEqual(adapter_raw.forward_pattern, "Pattern_3")
        self.assertTrue(adapter_raw.has_separate_cfg)

        transformer_turbo = _make_transformer("Krea2Transformer2DModel")
        transformer_turbo.transformer_blocks = blocks
        adapter_turbo = module._build_custom_block_adapter(
            transformer_turbo, has_separate_cfg=False
        )
        self.assertFalse(adapter_turbo.has_separate_cfg)

    def test_minimax_h3_uses_main_blocks_with_hidden_state_pattern(self):
        module = _import_module_with_stub()
        blocks = ["block_0", "block_1"]
        transformer = _make_transformer("MiniMaxH3DiTModel")
        transformer.blocks = blocks

        adapter = module._build_custom_block_adapter(transformer)

        self.assertEqual(adapter.blocks, blocks)
        self.assertEqual(adapter.forward_pattern, "Pattern_3")
        self.assertFalse(adapter.has_separate_cfg)

    def test_joint_cfg_decision_syncs_cfg_parallel_ranks(self):
        """A CFG pair batched into one forward decides once on one device; under
        CFG parallelism its ranks must vote together, while separate-CFG models
        keep their peers independent."""
        module = _import_module_with_stub()
        config = module.CacheDitConfig(enabled=True, num_inference_steps=6)
        dit_group = object()
        module.get_dit_group = lambda: dit_group
        module.get_classifier_free_guidance_world_size = lambda: 2
        for joint, expected in ((True, dit_group), (False, None)):
            with self.subTest(joint=joint):
                transformer = _make_transformer("Flux3ImageDiT")
                transformer.single_blocks = ["block_0"]
                transformer._context_manager = types.SimpleNamespace()
                module.enable_cache_on_transformer(
                    transformer, config, joint_cfg_decision=joint
                )
                self.assertIs(
                    getattr(transformer._context_manager, "_sglang_tp_sp_group", None),
                    expected,
                )

    def test_native_qwen21_adapter_overrides_generic_family_match(self):
        module = _import_module_with_stub()
        module.BlockAdapterRegister.supported = True
        transformer = _make_transformer("QwenImage21Transformer2DModel")
        transformer.transformer_blocks = ["block_0"]
        config = module.CacheDitConfig(enabled=True, num_inference_steps=6)

        module.enable_cache_on_transformer(transformer, config, has_separate_cfg=True)

        adapter = module.cache_dit.enable_calls[0]["target"]
        self.assertEqual(adapter.forward_pattern, "Pattern_3")
        self.assertTrue(adapter.has_separate_cfg)
        self.assertIs(adapter.blocks, transformer.transformer_blocks)

    def test_custom_adapter_is_retained_until_disable(self):
        module = _import_module_with_stub()
        module.BlockAdapterRegister.supported = False
        transformer = _make_transformer("MiniMaxH3DiTModel")
        transformer.blocks = ["block_0"]
        config = module.CacheDitConfig(enabled=True, num_inference_steps=50)

        returned = module.enable_cache_on_transformer(transformer, config)

        self.assertIs(returned, transformer)
        adapter = transformer._sglang_cache_dit_adapter
        self.assertIs(module.cache_dit.enable_calls[0]["target"], adapter)
        self.assertIs(module.disable_cache_on_transformer(transformer), transformer)
        self.assertEqual(module.cache_dit.disable_calls, [adapter])
        self.assertFalse(hasattr(transformer, "_sglang_cache_dit_adapter"))


class TestCalibratorSelection(unittest.TestCase):
    def _config(self, module, **kwargs):
        return module.CacheDitConfig(enabled=True, num_inference_steps=28, **kwargs)

    def test_dmd_takes_calibrator_slot(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("AnyModel")
        config = self._config(
            module,
            enable_dmd=True,
            dmd_history=8,
            dmd_rank=4,
            dmd_ridge=1e-6,
            dmd_svd_precision="high",
        )

        module.enable_cache_on_transformer(transformer, config)

        calibrator = module.cache_dit.enable_calls[0]["calibrator_config"]
        self.assertIsInstance(calibrator, module.DMDCalibratorConfig)
        self.assertEqual(
            calibrator.kwargs,
            {
                "dmd_history": 8,
                "dmd_rank": 4,
                "dmd_ridge": 1e-6,
                "dmd_svd_precision": "high",
            },
        )

    def test_both_calibrators_raise_on_transformer(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("AnyModel")
        config = self._config(module, enable_dmd=True, enable_taylorseer=True)

        with self.assertRaisesRegex(ValueError, "mutually exclusive"):
            module.enable_cache_on_transformer(transformer, config)
        self.assertEqual(module.cache_dit.enable_calls, [])

    def test_both_calibrators_raise_on_dual_transformer(self):
        module = _import_module_with_stub()
        transformer = _make_transformer("AnyModel")
        transformer.blocks = ["block_0"]
        transformer_2 = _make_transformer("AnyModel")
        transformer_2.blocks = ["block_0"]
        primary = self._config(module, enable_dmd=True, enable_taylorseer=True)
        secondary = self._config(module)

        with self.assertRaisesRegex(ValueError, "mutually exclusive"):
            module.enable_cache_on_dual_transformer(
                transformer,
                transformer_2,
                primary,
                secondary,
                model_name="wan2.2",
            )
        self.assertEqual(module.cache_dit.enable_calls, [])

    def test_dual_transformer_has_separate_cfg_follows_runtime(self):
        """Under CFG parallel each rank makes one Wan2.2 call per step;
        cache-dit must not pair consecutive calls as cond/uncond."""
        for runtime_flag in (True, False):
            with self.subTest(has_separate_cfg=runtime_flag):
                module = _import_module_with_stub()
                module.ParamsModifier = types.SimpleNamespace
                transformer = _make_transformer("AnyModel")
                transformer.blocks = ["block_0"]
                transformer_2 = _make_transformer("AnyModel")
                transformer_2.blocks = ["block_0"]

                module.enable_cache_on_dual_transformer(
                    transformer,
                    transformer_2,
                    self._config(module),
                    self._config(module),
                    model_name="wan2.2",
                    has_separate_cfg=runtime_flag,
                )

                adapter = module.cache_dit.enable_calls[0]["target"]
                self.assertEqual(adapter.has_separate_cfg, runtime_flag)


class TestCacheDitLegacyFallback(unittest.TestCase):
    """cache-dit < 1.5.0 (CI base jobs ship 1.3.0): fallback import + DMD guard."""

    def test_fallback_import_binds_registry_and_nulls_dmd(self):
        module, stubs = _import_module_with_legacy_stub()

        self.assertIsNone(module.DMDCalibratorConfig)
        self.assertIs(
            module.BlockAdapterRegister,
            stubs["cache_dit.caching.block_adapters"].BlockAdapterRegister,
        )

    def test_enable_dmd_raises_clear_error(self):
        module, _ = _import_module_with_legacy_stub()
        config = module.CacheDitConfig(
            enabled=True, enable_dmd=True, num_inference_steps=4
        )

        with self.assertRaisesRegex(ValueError, "cache-dit >= 1.5.0"):
            module.enable_cache_on_transformer(_make_transformer("AnyModel"), config)
        self.assertEqual(module.cache_dit.enable_calls, [])

    def test_taylorseer_path_still_enables_cache(self):
        module, _ = _import_module_with_legacy_stub()
        transformer = _make_transformer("AnyModel")
        config = module.CacheDitConfig(
            enabled=True,
            enable_dmd=False,
            enable_taylorseer=True,
            num_inference_steps=4,
        )

        result = module.enable_cache_on_transformer(transformer, config)

        self.assertIs(result, transformer)
        self.assertIsInstance(
            module.cache_dit.enable_calls[0]["calibrator_config"],
            _FakeTaylorSeerCalibratorConfig,
        )


class TestCacheDitRealPackageBoundary(unittest.TestCase):
    """Real installed cache-dit, no stubs: catches stub/package drift — the
    CI base jobs import this chain with cache-dit 1.3.0 while the diffusion
    unit lane installs 1.5.1."""

    @unittest.skipIf(
        importlib.util.find_spec("cache_dit") is None, "cache_dit is not installed"
    )
    def test_import_chain_matches_installed_package(self):
        script = (
            "import cache_dit\n"
            "import sglang.multimodal_gen.runtime.cache as cache_pkg\n"
            "from sglang.multimodal_gen.runtime.cache import cache_dit_integration\n"
            "print(hasattr(cache_dit, 'DMDCalibratorConfig'))\n"
            "print(cache_dit_integration.DMDCalibratorConfig is not None)\n"
            "print(cache_pkg.CacheDitConfig is cache_dit_integration.CacheDitConfig)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(
            result.returncode, 0, f"real import chain failed:\n{result.stderr}"
        )
        has_top_dmd, bound_not_none, reexport_ok = result.stdout.strip().splitlines()[
            -3:
        ]
        self.assertEqual(
            has_top_dmd,
            str(bound_not_none == "True"),
            "DMDCalibratorConfig binding mismatch vs installed package",
        )
        self.assertEqual(reexport_ok, "True")


if __name__ == "__main__":
    unittest.main()
