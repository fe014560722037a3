GO ?= go
PKGS ?= ./...

.PHONY: all build install test race bench lint fmt proto readme-check

all: lint test

build:
	$(GO) build $(PKGS)

# kvmesh, vllmsim and kvbench into $(go env GOPATH)/bin (or $GOBIN).
install:
	$(GO) install ./cmd/...

# Runs README.md's gateway and cluster sections as written (see the script).
readme-check:
	scripts/readme-check

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

# Regenerates the committed protobuf code. Needs Debian's protobuf-compiler
# and the Go plugins in $(go env GOPATH)/bin:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
PROTO_FILES = $(shell find proto -name '*.proto' | sort)
proto:
	PATH="$$($(GO) env GOPATH)/bin:$$PATH" protoc -I proto \
	  --go_out=proto --go_opt=module=github.com/kvmesh/kvmesh/proto \
	  --go-grpc_out=proto --go-grpc_opt=module=github.com/kvmesh/kvmesh/proto \
	  $(PROTO_FILES)
