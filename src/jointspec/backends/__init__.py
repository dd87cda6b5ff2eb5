"""Target and draft models behind one interface: the transformers adapter (with its cache and lean forward),
llama.cpp, the embedded default model, and loading."""
