GO ?= go
PKGS ?= ./...

.PHONY: all build test race bench lint fmt proto

all: lint test

build:
	$(GO) build $(PKGS)

# The same command README.md shows and .ci/run calls.
test:
	$(GO) test $(PKGS)

race:
	$(GO) test -race -short $(PKGS)

# Benchmarks: the figures quoted in issues and closing notes come from here.
bench:
	$(GO) test -run='^$$' -bench=. -benchmem $(PKGS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	  if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

fmt:
	gofmt -w $$(git ls-files '*.go' | grep -v '\.pb\.go$$')

# Regenerates the committed protobuf code (needs Debian's protobuf-compiler).
proto:
	@echo "no .proto files yet"
