"""``load_model``'s options (``--quantize``, ``--backend``, ``--threads``) and their plumbing through `generate`,
`bench` and `serve`: each reaches the loader, bad combinations are refused before anything loads, a bench runs
quantised copies beside the float target, and ``quantize=auto`` takes int4 only where that recovers the model's own
weights (backends/loading.py).

Tiny models saved into temporary folders (helpers.save_model, helpers.quant_llama); greedy decoding: no
false-failure odds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jointspec.backends.loading import load_model
from jointspec.cli import bench as bench_cli
from jointspec.cli import main as cli
from jointspec.core.errors import JointspecError, UnsupportedOptionError
from jointspec.kernels.grouped import kernels
from jointspec.kernels.quantize import quantization_mode

from helpers import VOCAB, assert_clean_error, quant_llama, run_cli, save_model, word_tokenizer

MODES = ["int8", "int4"]


# -- load_model: options and their combinations -----------------------------------------------------------------


@pytest.fixture(scope="module")
def quant_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("quant") / "model"
    quant_llama(0).save_pretrained(folder)
    word_tokenizer(VOCAB).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("mode", MODES)
def test_load_model_quantizes(quant_folder, mode):
    target, _ = load_model(quant_folder, quantize=mode)
    assert quantization_mode(target.model) == mode
    assert f"({mode})" in target.name
    plain, _ = load_model(quant_folder)
    assert quantization_mode(plain.model) == "none"  # the default is unchanged


@pytest.mark.parametrize("source, options, needle", [
    ("default", {"backend": "llamacpp", "quantize": "int8"}, "GGUF file's own quantisation"),
    ("some/folder", {"backend": "llamacpp"}, "loads GGUF files"),
    ("default", {"backend": "llamacpp", "device": "cuda"}, "runs on the CPU"),
    ("default", {"backend": "llamacpp", "dtype": "bfloat16"}, "dtype 'bfloat16'"),
    ("default", {"backend": "onnx"}, "unknown backend 'onnx'"),
    ("default", {"quantize": "fp8"}, "unknown quantisation 'fp8'"),
    ("default", {"threads": 0}, "threads must be a whole number >= 1"),
    ("default", {"backend": "llamacpp", "kernels": "onednn"}, "--kernels onednn is for the torch backend"),
    ("default", {"backend": "llamacpp", "kv_cache": "float16"}, "--kv-cache float16 is for the torch backend"),
])
def test_bad_load_options_fail_before_loading(source, options, needle):
    with pytest.raises(UnsupportedOptionError, match=needle):
        load_model(source, **options)


def test_llamacpp_backend_calls_the_llamacpp_loader(monkeypatch):
    # The real adapter is tested in test_backends_llamacpp; here only the hand-over: source, threads and name pass
    # through,
    # nothing goes through transformers.
    import jointspec.backends.llamacpp as llamacpp

    calls = []

    def fake_load(source, *, n_threads=None, n_ctx=4096, name=None, **_):
        calls.append((source, n_threads, name))
        return "adapter", "tokenizer"
    monkeypatch.setattr(llamacpp, "load_llamacpp", fake_load)
    assert load_model("/models/x.gguf", backend="llamacpp", threads=3, name="n") == ("adapter", "tokenizer")
    assert load_model("default", backend="llamacpp") == ("adapter", "tokenizer")
    assert calls == [("/models/x.gguf", 3, "n"), ("default", None, None)]



# -- command line -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_flags_parse_for_every_model_command(command):
    args = cli.build_parser().parse_args([command, "--quantize", "int4", "--backend", "llamacpp", "--threads", "3"])
    assert (args.quantize, args.backend, args.threads) == ("int4", "llamacpp", 3)
    args = cli.build_parser().parse_args([command])
    # generate and serve run the fastest exact configuration: int4 where that is the model's own weights (auto)
    assert (args.quantize, args.backend, args.threads) == ("none" if command == "bench" else "auto", "torch", None)
    if command != "bench":
        assert args.method == "default"


@pytest.mark.parametrize("option, value", [("--quantize", "int2"), ("--backend", "vllm"), ("--threads", "0")])
def test_bad_flag_values_are_argparse_errors(capsys, option, value):
    code, _, err = run_cli(capsys, "generate", "x", option, value)
    assert code == 2 and "Traceback" not in err and option in err.splitlines()[-1]


def generate_json(capsys, model: str, *extra: str) -> dict:
    code, out, err = run_cli(capsys, "generate", "w10 w11 w12 w10 w11 w12 w10", "--model", model, "--no-chat",
                             "--max-new-tokens", "12", "--json", *extra)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_generate_quantized_pld_equals_quantized_ar(capsys, quant_folder, mode):
    ar = generate_json(capsys, quant_folder, "--quantize", mode, "--threads", "1")
    pld = generate_json(capsys, quant_folder, "--quantize", mode, "--method", "pld")
    assert pld["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 12


def test_generate_refuses_bad_combinations_cleanly(capsys, quant_folder):
    code, _, err = run_cli(capsys, "generate", "x", "--model", quant_folder, "--backend", "llamacpp")
    assert_clean_error(code, err, "jointspec: error:", "loads GGUF files")
    code, _, err = run_cli(capsys, "generate", "x", "--backend", "llamacpp", "--quantize", "int4")
    assert_clean_error(code, err, "jointspec: error:", "GGUF file's own quantisation")


def prompts_file(folder: str) -> Path:
    path = Path(folder).parent / "prompts.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["w10 w11 w12 w10 w11"]}) + "\n")
    return path


def test_bench_loads_target_and_drafts_with_the_options(monkeypatch, capsys, quant_folder):
    # The target goes through bench's load_target seam with every option; a separate draft model goes through
    # load_model with the same options (here: a folder draft, quantised like the target).
    seen = {}

    def load_target(source, **options):
        seen.update(options)
        return load_model(source, **options)
    monkeypatch.setattr(bench_cli, "load_target", load_target)
    draft = save_model(str(quant_folder) + "-draft", 1)
    code, out, err = run_cli(capsys, "bench", "--no-progress", "--no-warmup", "--no-cost-model", "--no-perplexity",
                             "--prompts", str(prompts_file(quant_folder)), "--methods", f"ar,sps:draft={draft}",
                             "--max-new-tokens", "6", "--model", quant_folder, "--quantize", "int8",
                             "--threads", "1")
    assert code == 0, err
    assert "Loading weights" not in err  # --no-progress silences transformers' bar too
    assert seen == {"device": "cpu", "dtype": "auto", "quantize": "int8", "backend": "torch", "threads": 1,
                    "kernels": "auto", "kv_cache": "auto"}
    record = json.loads(out.strip().splitlines()[-1])
    assert all(m["num_identical"] == m["num_prompts"] == 1 for m in record["methods"].values()), record


def bench_outputs(capsys, folder: str, methods: str, *extra: str) -> dict[str, list[int]]:
    report = Path(folder).parent / "qreport"
    code, out, err = run_cli(capsys, "bench", "--no-progress", "--no-warmup", "--no-cost-model", "--no-perplexity",
                             "--prompts", str(prompts_file(folder)), "--model", folder, "--methods", methods,
                             "--max-new-tokens", "12", "--threads", "1", "--report-dir", str(report), *extra)
    assert code == 0, err
    runs = json.loads((report / "results.json").read_text())["runs"]
    return {run["method"]: run["output_ids"][0] for run in runs}


def test_bench_quantize_option_runs_a_quantised_copy_beside_the_float_target(monkeypatch, capsys, quant_folder):
    # Per-method quantize=: float and int4 rows in one run, the int4 ones sharing one quantised copy of the target.
    # The int4 rows must decode exactly as a bench whose target was loaded with --quantize int4 (and pld on the
    # copy must equal ar on it), and quantising the copy must leave the float target float.
    from jointspec.bench import runner

    copies, real_copy = [], runner.quantized_copy

    def quantized_copy(target, mode, kv_cache):
        assert kv_cache == "auto"  # bench's --kv-cache default, handed to the copies
        copies.append((target, real_copy(target, mode, kv_cache)))
        return copies[-1][1]
    monkeypatch.setattr(runner, "quantized_copy", quantized_copy)
    mixed = bench_outputs(capsys, quant_folder, "ar,ar:quantize=int4,pld:quantize=int4")
    assert len(copies) == 1
    original, copy = copies[0]
    assert quantization_mode(copy.model) == "int4" and quantization_mode(original.model) == "none"
    monkeypatch.undo()
    loaded_int4 = bench_outputs(capsys, quant_folder, "ar", "--quantize", "int4")["ar"]
    float_only = bench_outputs(capsys, quant_folder, "ar")["ar"]
    assert len(loaded_int4) == 12
    assert mixed["ar:quantize=int4"] == mixed["pld:quantize=int4"] == loaded_int4
    assert mixed["ar"] == float_only


def test_bench_default_runs_what_generate_runs(monkeypatch, capsys, quant_folder):
    """``default`` in the bench takes quantize=auto, as ``jointspec generate`` does: here the source is made to count
    as on the int4 grid, so it must run on the int4 copy (shared with ar:quantize=int4) and decode as int4 ``ar``;
    ``default:quantize=none`` stays on the float target and decodes as float ``ar``."""
    from jointspec.bench import runner

    asked, copies, real_copy = [], [], runner.quantized_copy

    def resolve(quantize, source, **options):
        asked.append((quantize, source))
        return "int4"

    def quantized_copy(target, mode, kv_cache):
        copies.append(mode)
        return real_copy(target, mode, kv_cache)
    monkeypatch.setattr(bench_cli, "resolve_quantize", resolve)
    monkeypatch.setattr(runner, "quantized_copy", quantized_copy)
    outputs = bench_outputs(capsys, quant_folder, "ar,default,ar:quantize=int4,default:quantize=none")
    assert asked == [("auto", quant_folder)] and copies == ["int4"]
    assert outputs["default"] == outputs["ar:quantize=int4"] and len(outputs["default"]) == 12
    assert outputs["default:quantize=none"] == outputs["ar"]
    # A bench whose target is loaded quantised already asks nothing and copies nothing.
    asked.clear()
    copies.clear()
    bench_outputs(capsys, quant_folder, "ar,default", "--quantize", "int8")
    assert asked == [] and copies == []


@pytest.mark.parametrize("methods, extra, needle", [
    ("ar,ar:quantize=int3", [], "quantize 'int3' in 'ar:quantize=int3' must be one of: auto, none, int8, int4"),
    ("ar,pld:backend=llamacpp,quantize=int4", [], "quantize is for the torch backend"),
    ("ar,ar:quantize=int4", ["--quantize", "int8"], "quantise a copy of the float torch target"),
    ("ar,hf-generate:quantize=int4", [], "unknown option 'quantize' for method 'hf-generate'"),
])
def test_bench_quantize_option_errors(monkeypatch, capsys, methods, extra, needle):
    def load_target(*_, **__):
        raise AssertionError("the options must be refused before anything loads")
    monkeypatch.setattr(bench_cli, "load_target", load_target)
    code, _, err = run_cli(capsys, "bench", "--no-progress", "--methods", methods, *extra)
    assert_clean_error(code, err, needle)



@pytest.mark.parametrize("extra, needle", [
    (["--methods", "ar,hybrid-tree:draft=self,tree_budget=4", "--temperature", "0.7"],
     "hybrid-tree: --tree-budget drafts for greedy decoding only, not at --temperature 0.7"),
    (["--methods", "ar,pld", "--method", "pld"], "bench runs the methods of --methods"),
])
def test_bench_method_option_errors(monkeypatch, capsys, extra, needle):
    def load_target(*_, **__):
        raise AssertionError("the options must be refused before anything loads")
    monkeypatch.setattr(bench_cli, "load_target", load_target)
    code, _, err = run_cli(capsys, "bench", "--no-progress", *extra)
    assert_clean_error(code, err, needle)

def test_serve_refuses_llamacpp_and_quantizes_on_torch(quant_folder):
    from jointspec.cli.serve import build_engine

    args = cli.build_parser().parse_args(["serve", "--model", quant_folder, "--backend", "llamacpp"])
    with pytest.raises(JointspecError, match="torch backend only"):
        build_engine(args)
    args = cli.build_parser().parse_args(["serve", "--model", quant_folder, "--quantize", "int4"])
    engine = build_engine(args)
    try:
        assert quantization_mode(engine.target.model) == "int4"
    finally:
        engine.close()


@pytest.mark.parametrize("extra, needle", [
    (["--methods", "ar,hf-generate", "--no-perplexity"], "hf-generate run transformers and need --backend torch"),
    (["--methods", "ar,pld"], "pass --no-perplexity"),
])
def test_bench_with_llamacpp_backend_refuses_what_needs_transformers(monkeypatch, capsys, extra, needle):
    def load_target(*_, **__):
        raise AssertionError("the options must be refused before anything loads")
    monkeypatch.setattr(bench_cli, "load_target", load_target)
    code, _, err = run_cli(capsys, "bench", "--no-progress", "--backend", "llamacpp", *extra)
    assert_clean_error(code, err, needle)



# -- quantize=auto: int4 where that is the model's own weights ------------------------------------------------------


def write_typed_gguf(path: Path, projection_type: str, head_type: str) -> Path:
    """A GGUF holding only tensors, each of the named quantisation type: all that on_int4_grid reads."""
    import gguf
    from gguf import quants

    writer = gguf.GGUFWriter(str(path), "llama")
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).numpy()

    def add(name: str, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)

    for layer in range(2):
        for projection in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            add(f"blk.{layer}.{projection}.weight", projection_type)
        add(f"blk.{layer}.attn_norm.weight", "F32")  # norms stay float in every GGUF
        writer.add_tensor(f"blk.{layer}.attn_q.bias", values[0])  # and biases (Qwen2's q/k/v): not projections
    add("output.weight", head_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_auto_takes_int4_only_where_the_kernels_take_the_files_own_blocks(tmp_path):
    from jointspec.backends.loading import on_int4_grid, resolve_quantize

    grid = write_typed_gguf(tmp_path / "q41.gguf", "Q4_1", "Q8_0")
    assert on_int4_grid("default") and on_int4_grid(str(grid))
    # Block types the kernels take as stored (kernels/gguf_blocks.py), and ones they do not.
    assert on_int4_grid(str(write_typed_gguf(tmp_path / "q40.gguf", "Q4_0", "Q8_0")))
    assert on_int4_grid(str(write_typed_gguf(tmp_path / "q50.gguf", "Q5_0", "Q4_1")))
    assert on_int4_grid(str(write_typed_gguf(tmp_path / "q51.gguf", "Q5_1", "Q8_0")))
    assert not on_int4_grid(str(write_typed_gguf(tmp_path / "f16.gguf", "F16", "Q8_0")))
    assert not on_int4_grid(str(write_typed_gguf(tmp_path / "f32.gguf", "F32", "F32")))
    assert not on_int4_grid(str(write_typed_gguf(tmp_path / "f16head.gguf", "Q4_1", "F16")))
    assert not on_int4_grid(str(tmp_path))  # a model folder
    from jointspec.kernels.grouped import selected_isa

    on_grid = "int4" if kernels() is not None and selected_isa() != "portable" else "none"
    assert resolve_quantize("auto", "default") == on_grid
    assert resolve_quantize("auto", str(grid)) == on_grid
    assert resolve_quantize("auto", str(tmp_path)) == "none"
    # Only the float32 torch model on the CPU, and not where transformers' own path is asked for.
    assert resolve_quantize("auto", "default", backend="llamacpp") == "none"
    assert resolve_quantize("auto", "default", dtype="bfloat16") == "none"
    assert resolve_quantize("auto", "default", kernels="stock") == "none"
    assert resolve_quantize("int8", str(tmp_path)) == "int8"  # named modes pass through


def test_auto_prepares_the_embedded_model_before_it_waits_for_the_kernels(monkeypatch, tmp_path):
    """``auto`` on the embedded default decides only after the kernels are built, which on a first run takes a
    minute or more, so load_model first prepares the model's files (on a first run it fetches and converts them,
    while grouped.prebuild's build runs), and reads its weights once, after, as decided: here through transformers
    (float32). A tiny folder stands in for the embedded model; test_kernels_gguf_blocks.py has the int4 side."""
    from jointspec.backends import embedded, loading

    folder = save_model(tmp_path / "model", seed=0)
    calls = []

    def read(source, device, dtype):
        calls.append(("read", source))
        return real_read(folder, device, dtype)

    def decide(quantize, source, **options):
        calls.append(("decide", quantize))
        return "none"
    real_read = loading._load_transformers
    monkeypatch.setattr(loading, "_load_transformers", read)
    monkeypatch.setattr(loading, "resolve_quantize", decide)
    monkeypatch.setattr(embedded, "prepare_default_model", lambda: calls.append(("prepare",)) or folder)
    monkeypatch.setattr(embedded, "default_gguf_path", lambda: calls.append(("gguf",)) or tmp_path / "absent.gguf")
    target, _ = load_model("default", quantize="auto")
    assert calls == [("prepare",), ("decide", "auto"), ("read", "default")]  # (a float load needs no GGUF)
    assert quantization_mode(target.model) == "none"
    calls.clear()
    load_model("default", quantize="none")  # a named mode: nothing to wait for, nothing prepared ahead
    assert calls == [("decide", "none"), ("read", "default")]


def test_the_embedded_models_identity_is_its_converted_folder_and_fetches_nothing(monkeypatch, tmp_path):
    """What a kept cost curve is filed under (source_identity) is read off the files the model loads from; it never
    fetches the GGUF wheel, which a cache without the GGUF's copy would otherwise download on every load (and fail
    offline: a machine with the converted model and no network could not load it)."""
    from jointspec.backends import embedded, loading

    def no_fetch(*args, **kwargs):
        raise AssertionError("the identity fetched the model")

    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "default_gguf_path", no_fetch)
    monkeypatch.setattr(embedded, "_fetch_gguf", no_fetch)
    assert loading.source_identity("default") is None  # nothing converted yet
    folder = embedded.default_model_dir()
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"1234")
    first = loading.source_identity("default")
    assert first is not None and "model.safetensors:4:" in first
    (folder / "model.safetensors").write_bytes(b"123456")  # converted again: another identity
    assert loading.source_identity(None) not in (None, first)


def test_auto_leaves_a_model_folder_in_float(tmp_path):
    target, _ = load_model(save_model(tmp_path / "model", seed=0), quantize="auto")
    assert quantization_mode(target.model) == "none"


def test_freed_heap_memory_goes_back_to_the_system():
    """What load_model does at its end (kernels/heap.py): the C library's free heap memory handed back. Heap blocks
    freed between live ones stay resident until trimmed. The blocks come from the C library itself, 64 KB each: under
    glibc's smallest threshold for mapping a block apart (128 KB, which it only ever raises), so they are heap blocks
    whatever the process allocated and freed before (a version of this test with 4 MB blocks from Python failed or
    passed with that history). Deterministic on glibc with its default tuning (a MALLOC_MMAP_THRESHOLD_ below 64 KB
    in the environment would fail it); skipped where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    from jointspec.kernels.heap import release_freed_memory

    def resident_mb() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))

    if not Path("/proc/self/status").exists() or not release_freed_memory():
        pytest.skip("needs glibc's malloc_trim and /proc")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    size = 64 << 10
    blocks = [libc.malloc(size) for _ in range(3072)]  # 192 MB
    assert all(blocks)
    try:
        for block in blocks:
            ctypes.memset(block, 1, size)  # resident
        for block in blocks[::2]:
            libc.free(block)  # holes between the blocks kept: the heap cannot shrink past them
        before = resident_mb()
        assert release_freed_memory()
        assert resident_mb() < before - 60  # about 96 MB of holes; 60 leaves room for other allocations
    finally:
        for block in blocks[1::2]:
            libc.free(block)


def test_a_gguf_cut_short_or_a_folder_is_named_as_such(tmp_path):
    """A GGUF cut inside its metadata was a bare struct.error traceback; a folder named x.gguf was "does not
    exist"."""
    from jointspec.backends.llamacpp import resolve_gguf
    from jointspec.core.errors import ModelLoadError

    whole = write_typed_gguf(tmp_path / "whole.gguf", "Q4_1", "Q8_0").read_bytes()
    for cut in (40, 1000):
        (tmp_path / f"cut{cut}.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="cut short or damaged"):
            load_model(str(tmp_path / f"cut{cut}.gguf"), quantize="none")
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="is a folder, not a GGUF file"):
        resolve_gguf(str(tmp_path / "folder.gguf"))


@pytest.mark.parametrize("quantize", ["none", "auto"])
def test_a_gguf_cut_inside_its_tensor_data_says_how_much_is_missing(tmp_path, quantize):
    """A file cut inside its tensor data (an interrupted download) was "cannot reshape array of size ..." from the
    reader, and on the llama.cpp backend blamed the tokenizer: now it is named as cut short, with the sizes, on
    transformers' path, on the int4 blocks' and (where llama-cpp-python is installed) on llama.cpp's."""
    from jointspec.core.errors import ModelLoadError
    from jointspec.kernels.gguf_reader import gguf_shortfall

    whole = write_typed_gguf(tmp_path / "whole.gguf", "Q4_1", "Q8_0")
    data = whole.read_bytes()
    assert gguf_shortfall(whole) is None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    assert gguf_shortfall(cut) == (len(data), len(data) - 100)
    message = f"is cut short: its header describes {len(data):,} bytes and the file holds {len(data) - 100:,}"
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(cut), quantize=quantize)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(cut), backend="llamacpp")


def test_a_wrong_model_name_says_what_is_wrong_with_it(tmp_path, monkeypatch):
    """A file that is not a GGUF was "does not exist"; a misspelt folder name read as a failed hub download; a GGUF
    whose shapes transformers' reader gets wrong (a Qwen3 file with heads 64 wide) was a traceback pointing at a
    report nobody saw."""
    import transformers

    from jointspec.core.errors import ModelLoadError

    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "model-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="has no config.json but holds model-q4.gguf: pass the GGUF file itself"):
        load_model(str(tmp_path / "only"), quantize="none")
    (tmp_path / "weights.bin").write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="is a file but not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"), quantize="none")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="there is no folder 'modle' here, and as a hub id it is not in"):
        load_model("modle", quantize="none")
    folder = tmp_path / "model"
    save_model(folder, 0)

    def mismatched(*args, **kwargs):
        raise RuntimeError("Error(s) in loading state_dict: size mismatch for q_proj. You set "
                           "ignore_mismatched_sizes to False, look at the above report!")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", mismatched)
    with pytest.raises(ModelLoadError, match="shapes differ from the model transformers built from its metadata"):
        load_model(str(folder), quantize="none")

    def other(*args, **kwargs):
        raise RuntimeError("a bug elsewhere")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", other)
    with pytest.raises(RuntimeError, match="a bug elsewhere"):  # not dressed up as a load error
        load_model(str(folder), quantize="none")


def test_a_cached_hub_id_that_fails_to_load_is_not_called_uncached(tmp_path, monkeypatch):
    """A hub id found in the cache whose files fail to load (an architecture transformers does not know) was told
    it is "not in this machine's cache": the cache is asked now, and only a real miss says so."""
    import huggingface_hub.constants

    from jointspec.backends import loading

    snapshot = tmp_path / "models--someone--odd-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (tmp_path / "models--someone--odd-model" / "refs").mkdir()
    (tmp_path / "models--someone--odd-model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert loading._in_hub_cache("someone/odd-model") and not loading._in_hub_cache("someone/absent")
    assert not loading._in_hub_cache("not a valid id!")
    monkeypatch.setattr(loading, "_in_hub_cache", lambda repo_id: True)
    with pytest.raises(JointspecError) as failed:
        load_model("someone/odd-model")
    assert "not in this machine's cache" not in str(failed.value)
    assert "could not load model 'someone/odd-model'" in str(failed.value)
