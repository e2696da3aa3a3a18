"""llama.cpp's own HF -> GGUF converter, as vendored by the llama-cpp-python sdist (the version the
llama.cpp peer runs), and its own quantizer (llama_model_quantize in the installed llama-cpp-python), for
benchmarks and tests that need GGUF files written the way users get them.

The sdist is fetched once with `pip download` (PyPI, like any package install; no model weights)
into a cache folder, under a file lock so that concurrent processes fetch it once, and only the
converter, its `conversion` package and `gguf-py` are unpacked. The converter runs as a subprocess
with gguf-py first on its path (the vendored gguf knows the newest architectures), so ember's own
environment is untouched.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile

VERSION = "0.3.36"
_VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# the converter, and Qwen's tokenizer as llama.cpp's tokenizer tests keep it (a vocab-only GGUF): the
# converter accepts only tokenizers whose pre-tokenizer it knows, so random models borrow this one
QWEN_VOCAB = "models/ggml-vocab-qwen2.gguf"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", QWEN_VOCAB)


def cache_dir() -> str:
    return os.environ.get(
        "EMBER_LLAMACPP_CONVERTER_CACHE",
        os.path.join(os.path.expanduser("~"), ".cache", "ember", f"llama.cpp-converter-{VERSION}"),
    )


def converter_dir() -> str:
    """The folder holding convert_hf_to_gguf.py (fetched on first use)."""
    root = cache_dir()
    done = os.path.join(root, "llama.cpp", QWEN_VOCAB)  # the last of what is unpacked
    if os.path.exists(done):
        return os.path.join(root, "llama.cpp")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching: wait for it
        if not os.path.exists(done):
            _fetch(root)
    return os.path.join(root, "llama.cpp")


def _fetch(root: str) -> None:
    sdist = os.path.join(root, f"llama_cpp_python-{VERSION}.tar.gz")
    if not os.path.exists(sdist):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={VERSION}",
                "-d",
                root,
            ],
            check=True,
        )
    target = os.path.join(root, "llama.cpp")
    staging = target + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)  # an older, smaller unpack
    with tarfile.open(sdist) as tar:
        members = [
            m for m in tar.getmembers() if m.name.startswith(_VENDOR) and m.name[len(_VENDOR) :].startswith(_WANTED)
        ]
        for m in members:
            m.name = m.name[len(_VENDOR) :]
        tar.extractall(staging, members=members, filter="data")
    os.replace(staging, target)  # whole or not at all: a killed fetch leaves no half converter
    os.remove(sdist)


def write_qwen_tokenizer(folder: str) -> int:
    """Qwen's byte-level BPE tokenizer (151,936 ids, as ember reads it from llama.cpp's vocab file) into an
    HF folder: tokenizer.json and tokenizer_config.json. Returns its vocabulary size."""
    from ember.loader.gguf import GGUFCheckpoint

    tok = GGUFCheckpoint(os.path.join(converter_dir(), QWEN_VOCAB)).tokenizer()
    tok.hf_tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"eos_token": tok.special_tokens.get("eos_token"), "bos_token": None, "chat_template": tok.chat_template}, f
        )
    return tok.vocab_size


def convert(
    hf_dir: str, out_path: str, outtype: str = "f32", extra_args: tuple[str, ...] = (), timeout: float = 1800
) -> str:
    """Run llama.cpp's converter on an HF folder; returns out_path. outtype: f32, f16, bf16, q8_0, ...;
    extra_args: more converter flags (e.g. --no-mtp for a Qwen3-Next / Qwen3.5 folder without mtp.*)."""
    conv = converter_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(conv, "gguf-py"), conv]), NO_LOCAL_GGUF="")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(conv, "convert_hf_to_gguf.py"),
            hf_dir,
            "--outfile",
            out_path,
            "--outtype",
            outtype,
            *extra_args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama.cpp's convert_hf_to_gguf.py failed on {hf_dir} (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return out_path


# llama_model_quantize in a child process: the library logs a line per tensor to the process's stderr
# (captured here), and an abort in C takes down the child, not the benchmark. argv[5] is a JSON object:
# per-tensor type overrides (regex -> ggml type name), the token embedding's / output's types, and the
# importance-matrix sizes (tensor name -> columns x experts) for a uniform matrix.
_QUANTIZE = (
    "import ctypes, json, sys, llama_cpp\n"
    "opts = json.loads(sys.argv[5])\n"
    "p = llama_cpp.llama_model_quantize_default_params()\n"
    "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3])\n"
    "p.nthread = int(sys.argv[4])\n"
    "ggml_type = lambda name: getattr(llama_cpp, 'GGML_TYPE_' + name.upper())\n"
    "if opts.get('token_embedding_type'): p.token_embedding_type = ggml_type(opts['token_embedding_type'])\n"
    "if opts.get('output_tensor_type'): p.output_tensor_type = ggml_type(opts['output_tensor_type'])\n"
    "over = list(opts.get('overrides', {}).items())\n"
    "if over:\n"
    "    tt = (llama_cpp.llama_model_tensor_override * (len(over) + 1))()\n"
    "    for i, (pattern, name) in enumerate(over): tt[i].pattern, tt[i].type = pattern.encode(), ggml_type(name)\n"
    "    p.tt_overrides = tt\n"
    "sizes = list(opts.get('imatrix', {}).items())\n"
    "if sizes:\n"
    "    ones = [(ctypes.c_float * n)(*([1.0] * n)) for _, n in sizes]\n"
    "    im = (llama_cpp.llama_model_imatrix_data * (len(sizes) + 1))()\n"
    "    for i, ((name, n), data) in enumerate(zip(sizes, ones)):\n"
    "        im[i].name, im[i].data, im[i].size = name.encode(), data, n\n"
    "    p.imatrix = im\n"
    "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n"
)


def uniform_imatrix_sizes(gguf_in: str) -> dict[str, int]:
    """Every matrix's importance-matrix length (its columns, times its experts): what a uniform importance
    matrix (all ones) needs. llama.cpp refuses IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS without
    one; all ones weighs every column alike, i.e. plain squared error, as its other types quantize without
    one. A real matrix (llama-imatrix over text) chooses better codes, but the file's format is the same."""
    from gguf import GGUFReader

    sizes = {}
    for t in GGUFReader(gguf_in).tensors:
        shape = [int(n) for n in t.shape]  # ggml order: columns first
        if len(shape) >= 2:
            sizes[t.name] = shape[0] * (shape[2] if len(shape) > 2 else 1)
    return sizes


def quantize(
    gguf_in: str,
    out_path: str,
    ftype: str,
    threads: int = 0,
    timeout: float = 1800,
    overrides: dict[str, str] | None = None,
    uniform_imatrix: bool = False,
    token_embedding_type: str | None = None,
    output_tensor_type: str | None = None,
) -> str:
    """llama.cpp's own quantizer (what `llama-quantize IN OUT FTYPE` runs) on a GGUF file; returns out_path.
    ftype: a llama_ftype name after LLAMA_FTYPE_MOSTLY_ (Q8_0, Q4_K_M, IQ2_XXS, ...), with llama.cpp's own
    choices per tensor (Q4_K_M writes some tensors Q6_K and keeps 1-d ones -- norms, conv, ssm_a,
    ssm_dt -- in F32); threads 0: all cores. overrides: tensor-name regex -> ggml type name (llama-quantize's
    --tensor-type), the first match wins; token_embedding_type / output_tensor_type: those two tensors' types
    (--token-embedding-type / --output-tensor-type); uniform_imatrix: hand in an all-ones importance matrix
    (uniform_imatrix_sizes), which the IQ1 / IQ2 / IQ3_XXS types require. Needs llama-cpp-python (the bench
    or test extra)."""
    from ember.bench.peers.llamacpp import import_llama_cpp

    import_llama_cpp()  # the install hint, before a child fails on the import
    opts = {
        "overrides": overrides or {},
        "imatrix": uniform_imatrix_sizes(gguf_in) if uniform_imatrix else {},
        "token_embedding_type": token_embedding_type,
        "output_tensor_type": output_tensor_type,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _QUANTIZE, gguf_in, out_path, ftype.upper(), str(threads), json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama.cpp's llama_model_quantize failed on {gguf_in} -> {ftype} (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}"
        )
    return out_path


def set_metadata_ints(path: str, key: str, values: list[int], head_bytes: int = 64 << 20) -> str:
    """Overwrite an int32 / uint32 value, or an int32 / uint32 array's items, of a GGUF file's metadata in place
    (an array must already hold len(values) items; a single value takes one): after the key's name comes its
    value type (4 bytes), then the value, or for an array its item type (4) and count (8), then the items. Only
    the file's head is read (the metadata, vocabulary included, sits in the first few MiB), so a file of many
    GiB is patched in milliseconds. llama.cpp's converter under transformers >= 5.23 writes
    qwen4exp.attention.compress_ratios all 0 (tests/loader/test_gguf_qwen4.py)."""
    import struct

    with open(path, "r+b") as f:
        head = f.read(head_bytes)
        name = key.encode()
        at = head.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        (value_type,) = struct.unpack_from("<I", head, at)
        if value_type == 9:  # GGUFValueType.ARRAY
            _, _, count = struct.unpack_from("<IIQ", head, at)
            skip = 16
        elif value_type in (4, 5):  # one UINT32 / INT32 value
            count, skip = 1, 4
        else:
            raise ValueError(f"{key} in {path} is of GGUF value type {value_type}, not an int32 / uint32 or an array")
        if count != len(values):
            raise ValueError(f"{key} holds {count} items in {path}, not {len(values)}")
        f.seek(at + skip)
        f.write(struct.pack(f"<{len(values)}i", *values))
    return path


def quantize_many(gguf_in: str, jobs: dict[str, tuple[str, bool]], threads: int = 0, timeout: float = 1800) -> None:
    """Several quantize() runs over one file in one child process (one start of Python and llama.cpp instead of
    one a file: tests that write a file per type). jobs: out_path -> (ftype, uniform_imatrix), as quantize's."""
    from ember.bench.peers.llamacpp import import_llama_cpp

    import_llama_cpp()
    sizes = None
    argvs = []
    for out_path, (ftype, uniform) in jobs.items():
        if uniform and sizes is None:
            sizes = uniform_imatrix_sizes(gguf_in)
        opts = {"imatrix": sizes if uniform else {}}
        argvs.append([gguf_in, out_path, ftype.upper(), str(threads), json.dumps(opts)])
    loop = (
        "import json, sys\n"
        f"script = {_QUANTIZE!r}\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['-c', *argv]\n"
        "    try:\n"
        "        exec(script, {})\n"
        "    except SystemExit as stop:\n"
        "        if stop.code:\n"
        "            sys.exit(f'{argv[2]}: exit {stop.code}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", loop, json.dumps(argvs)], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's llama_model_quantize failed on {gguf_in}:\n{proc.stderr[-4000:]}")


# IQ / K-quant mixes in the manner of unsloth's dynamic ("UD") GGUFs of MoE models, for benchmark files:
# llama.cpp's own ftype mix as the base, the experts and attention moved to IQ types by per-tensor overrides
# (first match wins). What their files hold (llama.cpp's load logs): Qwen3-30B-A3B UD-IQ1_S: ffn_gate/up_exps
# IQ1_S / IQ1_M / IQ2_XXS, ffn_down_exps IQ2_S / IQ3_XXS, attention IQ3_S / IQ3_XXS / IQ4_XS / Q5_K, token_embd
# Q4_K, output Q6_K (ggml-org/llama.cpp#14199); Qwen3.8-27B UD-Q2_K_XL: mostly IQ3_XXS, IQ2_S, IQ3_S, IQ2_XXS,
# IQ2_XS, with Q8_0 on the small SSM matrices and Q2_K..Q6_K here and there (anthony-chaudhary/fak#9820).
# Their per-layer choices come from an importance matrix over calibration text; these fix one type per role.
# Rows whose width is not a multiple of 256 (Flash-Next's ffn_down_exps, 640; per_layer_token_embd, 160) take
# llama.cpp's fallback, a 32-element type (IQ4_NL for the IQ types, Q4_0 for Q2_K / Q3_K).
_ATTN = r"\.(attn_q|attn_k|attn_v|attn_qkv|attn_gate)\.weight$"
_ATTN_OUT = r"\.(attn_output|ssm_out)\.weight$"
# qwen4exp's n-gram table: llama.cpp gives token_embedding_type to every name holding "token_embd", and its
# rows (64 wide in the bench model, 160 in the release) cannot take a 256-element type (Q4_K there fails
# llama.cpp's own validation with NaNs): a 32-element IQ type, as the IQ files' fallback would be
_PLE_TABLE = r"^per_layer_token_embd\.weight$"
MIXES = {
    "UD-Q2_K_XL": dict(
        ftype="Q2_K",
        token_embedding_type="Q4_K",
        output_tensor_type="Q6_K",
        overrides={
            _PLE_TABLE: "IQ4_NL",
            r"\.ffn_down_exps\.weight$": "IQ3_XXS",
            r"\.ffn_(gate|up)_exps\.weight$": "IQ2_XXS",
            r"\.ffn_(gate|up|down)_shexp\.weight$": "Q4_K",
            r"\.ssm_(alpha|beta)\.weight$": "Q8_0",
            _ATTN: "IQ3_XXS",
            _ATTN_OUT: "IQ4_XS",
        },
    ),
    "UD-IQ1_S": dict(
        ftype="IQ1_S",
        token_embedding_type="Q4_K",
        output_tensor_type="Q6_K",
        overrides={
            _PLE_TABLE: "IQ4_NL",
            r"^blk\.[0-2]\.ffn_(gate|up)_exps\.weight$": "IQ2_XXS",  # the first layers a step up
            r"\.ffn_down_exps\.weight$": "IQ2_S",
            r"\.ffn_(gate|up)_exps\.weight$": "IQ1_S",
            r"\.ffn_(gate|up|down)_shexp\.weight$": "Q4_K",
            r"\.ssm_(alpha|beta)\.weight$": "Q8_0",
            _ATTN: "IQ3_S",
            _ATTN_OUT: "IQ4_XS",
        },
    ),
}


def quantize_mix(gguf_in: str, out_path: str, mix: str, threads: int = 0, timeout: float = 7200) -> str:
    """A MIXES recipe ("UD-Q2_K_XL", "UD-IQ1_S") by llama.cpp's quantizer, with a uniform importance matrix
    (uniform_imatrix_sizes: the IQ types require one); returns out_path."""
    return quantize(gguf_in, out_path, threads=threads, timeout=timeout, uniform_imatrix=True, **MIXES[mix])
