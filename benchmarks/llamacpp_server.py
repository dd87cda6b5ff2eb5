"""llama-cpp-python's OpenAI server (``python -m llama_cpp.server``, same arguments), loading its model as jointspec's
llama.cpp backend and the bench's ``llamacpp`` rows do: without llama.cpp's extra buffer types on CPUs with AMX,
whose AMX kernels segfault in llama-cpp-python 0.3.36 at the first decode of more than one token
(``jointspec.backends.llamacpp.use_extra_buffer_types``; docs/kernels.md, "llama.cpp"). Elsewhere nothing changes.
``serve_vs_llamacpp.py`` starts llama.cpp's server through this file.

    python benchmarks/llamacpp_server.py --model FILE.gguf --n_threads 2 --port 8000
"""

import runpy

from jointspec.backends.llamacpp import llama_class_params, use_extra_buffer_types

if __name__ == "__main__":
    print(f"llamacpp_server: llama.cpp's extra buffer types {'on' if use_extra_buffer_types() else 'off (AMX)'}",
          flush=True)
    with llama_class_params():  # for the server's whole life: it loads its model inside, at start-up
        runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
