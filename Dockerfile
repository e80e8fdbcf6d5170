# syntax=docker/dockerfile:1
# The quantrouter image: a static binary on distroless, running as non-root (65532), the
# plain release build (`cargo build --release`) for the target's musl libc.
#   docker build -t ghcr.io/quantrouter/quantrouter:0.1.0 .
# ENTRYPOINT is `quantrouter serve`, so the chart's args are serve flags only. For the
# operator commands use `--entrypoint quantrouter`, e.g. `profiles push`.

FROM --platform=$BUILDPLATFORM rust:1-bookworm AS builder
ARG TARGETARCH
# musl for a fully static binary (distroless/static has no libc); its gcc builds ring & co.
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
RUN case "$TARGETARCH" in \
      amd64) echo x86_64-unknown-linux-musl ;; \
      arm64) echo aarch64-unknown-linux-musl ;; \
      *) echo "unsupported TARGETARCH $TARGETARCH" >&2; exit 1 ;; \
    esac > /rust-target \
 && rustup target add "$(cat /rust-target)"
WORKDIR /src
COPY . .
# No profile-guided build: the benchmark suite measures the plain release build, and an image
# built differently would ship something the numbers do not describe (docs/performance.md).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p quantrouter --target "$(cat /rust-target)" \
 && cp "target/$(cat /rust-target)/release/quantrouter" /quantrouter

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=builder /quantrouter /usr/local/bin/quantrouter
USER 65532:65532
# 8080 OpenAI-compatible API, 9090 admin (metrics, health, profiles, KEDA), 9091 KEDA gRPC.
EXPOSE 8080 9090 9091
ENTRYPOINT ["/usr/local/bin/quantrouter", "serve"]
