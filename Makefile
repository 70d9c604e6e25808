# dpar - make demo | test | check | bench | docs | cuda | format | install | clean
#
#   make demo    build and run the demo (a char-level language model, data-parallel)
#   make test    formatting, layout, docs/api.md coverage, compile matrix + every test (OpenBLAS, MPI and CUDA parts run when found)
#   make check   the test programs under AddressSanitizer+UBSan, then ThreadSanitizer
#   make bench   benchmarks, one machine-readable line per figure
#   make docs    the pictures of docs/img/ from their recorded sources (make docs-record, docs-bench: record again)
#   make stress the long stress and kill tests (minutes)
#   make fuzz    the libFuzzer targets of tests/fuzz, FUZZ_SECONDS each (default 60; needs clang)
#   make format  rewrite the C files as clang-format 14 writes them (.clang-format); make test checks them
#   make install copy the headers to $(PREFIX)/include
#
# Optional dependencies are detected; each gets one line saying whether it was found.

CC      ?= cc
CXX     ?= c++
BUILD   ?= build
PREFIX  ?= /usr/local
OPT     ?= -O2 -g
WARN    := -Wall -Wextra -Wpedantic -Werror
CFLAGS  := -std=c99 $(OPT) $(WARN) -I. -Itests
LDLIBS  := -pthread -lm

NVCC    := $(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc))
CUDA_HOME := $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC))))
CUBLAS  := $(if $(CUDA_HOME),$(firstword $(wildcard $(CUDA_HOME)/lib64/libcublas.so $(CUDA_HOME)/targets/*/lib/libcublas.so)))
NCCL    := $(if $(CUDA_HOME),$(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h)))
MPICC   := $(shell command -v mpicc 2>/dev/null)
MPIRUN  := $(shell command -v mpirun 2>/dev/null)
OPENBLAS := $(shell printf '\043include <cblas.h>\nint main(void){return 0;}\n' | $(CC) -x c - -o /dev/null -lopenblas >/dev/null 2>&1 && echo yes)
OPENMP  := $(shell printf 'int main(void){return 0;}\n' | $(CC) -fopenmp -x c - -o /dev/null >/dev/null 2>&1 && echo yes)

ifeq ($(filter-out clean format,$(or $(MAKECMDGOALS),all)),)
else
$(info dpar: OpenBLAS $(if $(OPENBLAS),found (-lopenblas),not found: the built-in GEMM is used))
$(info dpar: MPI $(if $(and $(MPICC),$(MPIRUN)),found ($(MPICC), $(MPIRUN)),not found: MPI tests and examples are skipped))
$(info dpar: nvcc $(if $(NVCC),found ($(NVCC)),not found: CUDA checks are skipped))
$(if $(NVCC),$(info dpar: cuBLAS $(if $(CUBLAS),found ($(CUBLAS)),not found: dpar_cuda_sgemm cannot link)))
$(if $(NVCC),$(info dpar: NCCL $(if $(NCCL),found ($(NCCL)),not found: the NCCL transport (DPAR_NCCL) is skipped)))
endif

TESTS   := $(patsubst tests/%.c,$(BUILD)/%,$(filter-out tests/test_mpi.c,$(wildcard tests/test_*.c)))
HEADERS := dpar.h tests/dpar_test.h tests/json.h tests/coll_matrix.h tests/pipe_mlp.h tests/stress.h
MPITEST := $(if $(and $(MPICC),$(MPIRUN)),$(BUILD)/test_mpi)
MPIASAN := $(if $(MPITEST),$(BUILD)/asan/test_mpi)

.PHONY: all demo test check bench docs docs-record docs-bench cuda format mutate fuzz stress install clean
all: $(TESTS) $(BUILD)/pool_demo $(BUILD)/char_lm

$(BUILD):
	@mkdir -p $(BUILD) $(BUILD)/asan $(BUILD)/tsan

$(BUILD)/test_%: tests/test_%.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) $< -o $@ $(LDLIBS)

# the GEMM tests with OpenBLAS (when found) and with the portable micro-kernel
$(BUILD)/openblas_test_gemm: tests/test_gemm.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -DDPAR_OPENBLAS $< -o $@ $(LDLIBS) -lopenblas

$(BUILD)/noavx2_test_gemm: tests/test_gemm.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -DDPAR_NO_AVX2 $< -o $@ $(LDLIBS)

# the pool tests once more with the portable parking lot instead of futexes
$(BUILD)/nofutex_test_pool: tests/test_pool.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -DDPAR_NO_FUTEX $< -o $@ $(LDLIBS)

$(BUILD)/test_mpi: tests/test_mpi.c $(HEADERS) | $(BUILD)
	$(MPICC) $(CFLAGS) $< -o $@ $(LDLIBS)

$(BUILD)/asan/test_mpi: tests/test_mpi.c $(HEADERS) | $(BUILD)
	$(MPICC) -std=c99 -O1 -g $(WARN) -I. -Itests -fsanitize=address,undefined -fno-sanitize-recover=all $< -o $@ $(LDLIBS)

$(BUILD)/asan/test_%: tests/test_%.c $(HEADERS) | $(BUILD)
	$(CC) -std=c99 -O1 -g $(WARN) -I. -Itests -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer $< -o $@ $(LDLIBS)

$(BUILD)/tsan/test_%: tests/test_%.c $(HEADERS) | $(BUILD)
	$(CC) -std=c99 -O1 -g $(WARN) -I. -Itests -fsanitize=thread $< -o $@ $(LDLIBS)

$(BUILD)/pool_demo: examples/pool_demo.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

$(BUILD)/char_lm: demo/char_lm.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

# the training benchmark runs the example as it is (the built-in GEMM)
$(BUILD)/data_parallel: examples/data_parallel.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

$(BUILD)/fsdp: examples/fsdp.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

$(BUILD)/tensor_parallel: examples/tensor_parallel.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

$(BUILD)/context_parallel: examples/context_parallel.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_pool: bench/bench_pool.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 -fopenmp -I. $< -o $@ $(LDLIBS)

# the OpenMP port of examples/omp_port.c, timed beside its OpenMP original (needs -fopenmp)
# -falign-loops=64: the same loop bodies aligned alike in both versions (see docs/openmp.md, 'Speed')
$(BUILD)/omp_port: examples/omp_port.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 -falign-loops=64 -fopenmp -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_cores: bench/bench_cores.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_pipe: bench/bench_pipe.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_gemm: bench/bench_gemm.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 -DDPAR_OPENBLAS -I. $< -o $@ $(LDLIBS) -lopenblas

$(BUILD)/mpi_data_parallel: examples/mpi_data_parallel.c dpar.h | $(BUILD)
	$(MPICC) -std=c99 -O2 $(WARN) -I. $< -o $@ -lm

$(BUILD)/bench_mpi: bench/bench_mpi.c bench/line_probe.h dpar.h | $(BUILD)
	$(MPICC) -std=c99 -O2 -I. $< -o $@ $(LDLIBS)

# -O3 so that the reference pass out = x + y is vectorised too
$(BUILD)/bench_comm: bench/bench_comm.c bench/line_probe.h dpar.h | $(BUILD)
	$(CC) -std=c99 -O3 -I. $< -o $@ $(LDLIBS)

# the trainer demo: 4 to 13 s of training on 2 cores (idle to loaded), 15 to 35 s with the first build (README.md).
# It starts afresh each time (--overwrite replaces the checkpoint an earlier make demo left); its checkpoint is
# build/char_lm.ckpt, the default path of build/char_lm, so a plain `build/char_lm --resume --steps 3000` continues it
demo: $(BUILD)/char_lm
	$(BUILD)/char_lm --overwrite

VARIANTS := $(BUILD)/nofutex_test_pool $(BUILD)/noavx2_test_gemm $(if $(OPENBLAS),$(BUILD)/openblas_test_gemm)

test: $(TESTS) $(VARIANTS) $(MPITEST)
	@NVCC="$(NVCC)" MPICC="$(MPICC)" MPIRUN="$(MPIRUN)" MPITEST="$(MPITEST)" OPENBLAS="$(OPENBLAS)" BUILD="$(BUILD)" \
	    tests/run.sh --matrix $(TESTS) $(VARIANTS)

# MPI tests run under ASan+UBSan with leak detection off (Open MPI keeps memory until exit); not
# under TSan, which does not see Open MPI's own synchronisation and reports races inside it.
check: $(patsubst $(BUILD)/%,$(BUILD)/asan/%,$(TESTS)) $(patsubst $(BUILD)/%,$(BUILD)/tsan/%,$(TESTS)) $(MPIASAN)
	@echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
	@ASAN_OPTIONS=detect_leaks=1 DPAR_TEST_BIG=100003 MPIRUN="$(MPIRUN)" MPITEST="$(MPIASAN)" MPIASAN=1 BUILD="$(BUILD)" \
	    tests/run.sh $(patsubst $(BUILD)/%,$(BUILD)/asan/%,$(TESTS))
	@echo "== ThreadSanitizer"
	@TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" DPAR_TEST_BIG=100003 BUILD="$(BUILD)" \
	    tests/run.sh --no-mpi-reason "Open MPI is not built with ThreadSanitizer" $(patsubst $(BUILD)/%,$(BUILD)/tsan/%,$(TESTS))

bench: $(BUILD)/bench_pool $(if $(OPENMP),$(BUILD)/omp_port) $(BUILD)/bench_comm $(BUILD)/bench_pipe $(BUILD)/data_parallel $(BUILD)/fsdp $(BUILD)/tensor_parallel $(BUILD)/context_parallel $(BUILD)/bench_cores $(if $(MPITEST),$(BUILD)/bench_mpi $(BUILD)/mpi_data_parallel) $(if $(OPENBLAS),$(BUILD)/bench_gemm)
ifeq ($(OPENMP),yes)
	./$(BUILD)/bench_pool
	./$(BUILD)/omp_port --bench | grep '^bench='
else
	@echo "bench: $(CC) has no -fopenmp; the pool benchmark and bench=omp_port need OpenMP as their reference"
endif
	./$(BUILD)/bench_comm
	./$(BUILD)/bench_pipe
	bench/bench_train.sh ./$(BUILD)/data_parallel ./$(BUILD)/bench_cores
	./$(BUILD)/fsdp --stage 2 --bench | grep '^bench='
	./$(BUILD)/fsdp --stage 3 --bench | grep '^bench='
	./$(BUILD)/tensor_parallel --bench | grep '^bench='
	./$(BUILD)/context_parallel --bench | grep '^bench='
ifneq ($(OPENBLAS),)
	./$(BUILD)/bench_gemm
else
	@echo "bench: OpenBLAS not found: bench=gemm (which compares against it) skipped"
endif
ifneq ($(MPITEST),)
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(MPIRUN) -np 2 ./$(BUILD)/bench_mpi
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 bench/bench_mpi_startup.sh ./$(BUILD)/mpi_data_parallel $(MPIRUN)
else
	@echo "bench: MPI not found: bench=allreduce transport=mpi skipped"
endif

# the pictures of docs/img/ (docs/gen/svg.c): drawn from dpar's ring and pipeline schedules, run here, and from the
# sources recorded in docs/img/src/ (a trace, examples' memory figures, a make bench run), so the same tree gives the
# same bytes; make test checks them (tests/docs.sh). docs-record records the trace and memory figures again,
# docs-bench the benchmark output (a whole make bench: minutes); then make docs, and commit sources and pictures.
$(BUILD)/svg: docs/gen/svg.c dpar.h | $(BUILD)
	$(CC) -std=c99 -O2 $(WARN) -I. $< -o $@ $(LDLIBS)

docs: $(BUILD)/svg
	./$(BUILD)/svg

docs-record:
	BUILD="$(BUILD)" docs/gen/record.sh

docs-bench:
	BUILD="$(BUILD)" docs/gen/record.sh --bench

cuda: | $(BUILD)
ifneq ($(NVCC),)
	NVCC="$(NVCC)" BUILD="$(BUILD)" tests/gpu.sh
else
	@echo "cuda: nvcc not found"
endif

# the C files as clang-format writes them (tests/format.sh --fix; make test runs the check)
format:
	tests/format.sh --fix

# libFuzzer targets (tests/fuzz/): each runs FUZZ_SECONDS on its seeds (tests/fuzz/corpus_*) plus what it found
# before (build/fuzz/corpus_*); a crash leaves its input as build/fuzz/crash-* and fails the target
FUZZ_SECONDS ?= 60
FUZZCC  ?= clang
FUZZERS := idx ckpt env pipe
$(BUILD)/fuzz/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_common.h $(HEADERS)
	@mkdir -p $(BUILD)/fuzz
	$(FUZZCC) -std=c99 -O1 -g -Wall -Wextra -Wno-unused-function -I. -Itests \
	    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all $< -o $@ -pthread -lm

fuzz: $(patsubst %,$(BUILD)/fuzz/fuzz_%,$(FUZZERS))
	@for t in $(FUZZERS); do \
	    echo "== fuzz_$$t for $(FUZZ_SECONDS) s"; mkdir -p $(BUILD)/fuzz/corpus_$$t; \
	    ./$(BUILD)/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz/ \
	        $(BUILD)/fuzz/corpus_$$t tests/fuzz/corpus_$$t >$(BUILD)/fuzz/fuzz_$$t.log 2>&1 \
	        || { tail -40 $(BUILD)/fuzz/fuzz_$$t.log; echo "fuzz_$$t: FAILED (log: $(BUILD)/fuzz/fuzz_$$t.log)"; exit 1; }; \
	    grep -aE 'DONE|stat::number_of_executed_units' $(BUILD)/fuzz/fuzz_$$t.log; \
	done

# the long forms: 100000 mixed collectives on 8 thread ranks (and 10000 under ASan and TSan), on 4 oversubscribed
# MPI processes, and 200 kills each of the demo trainer and examples/data_parallel.c (tests/kill.sh); minutes
STRESS_ITERS ?= 100000
stress: $(BUILD)/test_stress $(BUILD)/asan/test_stress $(BUILD)/tsan/test_stress $(MPITEST)
	DPAR_STRESS_ITERS=$(STRESS_ITERS) ./$(BUILD)/test_stress
	DPAR_STRESS_ITERS=$$(( $(STRESS_ITERS) / 10 )) ./$(BUILD)/asan/test_stress stress
	DPAR_STRESS_ITERS=$$(( $(STRESS_ITERS) / 10 )) ./$(BUILD)/tsan/test_stress stress
	BUILD="$(BUILD)" MPICC="$(MPICC)" MPIRUN="$(MPIRUN)" tests/kill.sh 200
ifneq ($(MPITEST),)
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 DPAR_STRESS_ITERS=$(STRESS_ITERS) \
	    $(MPIRUN) --oversubscribe -np 4 ./$(BUILD)/test_mpi
else
	@echo "stress: MPI not found: the MPI stress is skipped"
endif

# the planted bugs of tests/mutations.txt, each of which its test must catch (minutes: one build and run each)
mutate:
	tests/mutate.sh

install:
	install -d $(DESTDIR)$(PREFIX)/include
	install -m 644 dpar.h dpar_cuda.h $(DESTDIR)$(PREFIX)/include

clean:
	rm -rf $(BUILD)
