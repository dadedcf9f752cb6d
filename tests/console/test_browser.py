"""The web console in a real headless Chromium (Debian's, driven by Playwright) against a live
``ember serve``: a wrong key is refused; alice signs in and sees her run, whose loss curve is drawn
from the steps she trained through the SDK; a checkpoint downloads byte for byte; the playground's
greedy text equals the SDK's greedy sample of her checkpoint; a checkpoint is deleted; bob, signed
in with his key, sees none of it and is refused her data. Screenshots go to ``tmp_path``, or to
``$EMBER_SCREENSHOTS`` (``docs/console`` when refreshing the docs)."""

import itertools
import os
from pathlib import Path

import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.reliability.live import MODEL, live_server

CHROMIUM = os.environ.get("EMBER_CHROMIUM", "/usr/bin/chromium")
# Chromium as root, with nothing reaching outside (this machine's network is closed)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
STEPS = 12
TEXT = "Training loss goes down when the model learns; sampling draws tokens from the model's distribution."
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A live server where alice trained STEPS steps and saved a sampler and a training checkpoint."""
    root = tmp_path_factory.mktemp("console")
    with live_server(root / "server") as live:
        sc = tinker.ServiceClient(base_url=live.base_url, api_key=live.keys["alice"])
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
        seq = AutoTokenizer.from_pretrained(str(live.model_dir))(TEXT)["input_ids"]
        datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})
        losses = []
        for _ in range(STEPS):
            fb = tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        sampler_path = tc.save_weights_for_sampler("console-sampler").result().path
        state_path = tc.save_state("console-state").result().path
        yield {"live": live, "sc": sc, "tc": tc, "losses": losses, "sampler": sampler_path, "state": state_path,
               "run": tc.model_id}
        sc.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found: the console test needs Debian's chromium (apt-get install chromium; "
                    f"scripts/setup installs it) or EMBER_CHROMIUM=/path/to/chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def _shots(tmp_path) -> Path:
    out = Path(os.environ.get("EMBER_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _sign_in(page, base_url: str, key: str) -> None:
    page.goto(f"{base_url}/console")
    page.fill("#key", key)
    page.click("#signin-form button[type=submit]")


def test_console(trained, browser, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    live, shots = trained["live"], _shots(tmp_path)
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    # a wrong key is refused, and nothing is shown
    _sign_in(page, live.base_url, "tml-not-a-key")
    expect(page.locator("#signin-error")).to_contain_text("not accepted")
    assert page.locator("#tabs").is_hidden()

    # alice: her run, its curve from the steps she trained
    _sign_in(page, live.base_url, live.keys["alice"])
    expect(page.locator("#who")).to_contain_text("signed in as")
    row = page.locator(f'#runs-table tbody tr[data-id="{trained["run"]}"]')
    expect(row).to_have_count(1)
    row.click()
    expect(page.locator("#metric")).to_have_value("loss:sum")
    curve = page.locator("#chart polyline[data-op=forward_backward]")
    expect(curve).to_have_attribute("data-points", str(STEPS))
    expect(page.locator("#chart polyline[data-op=optim_step]")).to_have_count(0)  # no loss:sum there
    # the curve's points are the losses the SDK got back, in step order: a larger loss is drawn
    # higher (a smaller y), wherever two differ by more than a pixel's worth; the last one is named
    ys = [float(p.split(",")[1]) for p in curve.get_attribute("points").split()]
    losses = trained["losses"]
    span = max(losses) - min(losses)
    for i, j in itertools.combinations(range(STEPS), 2):
        if abs(losses[i] - losses[j]) > 0.01 * span:
            assert (ys[i] < ys[j]) == (losses[i] > losses[j]), (i, j, ys, losses)
    expect(page.locator("#chart-note")).to_contain_text(f"{STEPS} points")
    note = page.locator("#chart-note").text_content()
    assert abs(float(note.rsplit(":", 1)[1]) - losses[-1]) <= 1e-4 * abs(losses[-1]), (note, losses)
    page.select_option("#metric", "learning_rate")
    expect(page.locator("#chart polyline[data-op=optim_step]")).to_have_attribute("data-points", str(STEPS))
    page.select_option("#metric", "loss:sum")
    expect(page.locator("#ckpt-table tbody tr")).to_have_count(2)
    page.screenshot(path=str(shots / "console-run.png"), full_page=True)

    # a checkpoint's files download byte for byte
    ckpt = page.locator(f'#ckpt-table tbody tr[data-id="{trained["sampler"]}"]')
    ckpt.locator("button.download").click()
    links = ckpt.locator("a.file")
    expect(links.first).to_be_visible()
    names = [a.get_attribute("download") for a in links.all()]
    assert "adapter.safetensors" in names, names
    link = ckpt.locator('a.file[download="adapter.safetensors"]')
    with page.expect_download() as info:
        link.click()
    got = Path(info.value.path()).read_bytes()
    with live.http() as http:
        listing = http.get("/console/api/checkpoint_files", params={"path": trained["sampler"]}).json()
        url = next(f["url"] for f in listing["files"] if f["name"] == "adapter.safetensors")
        want = http.get(url).content
    assert got == want and len(got) > 1000

    # the playground: greedy text of the checkpoint equals the SDK's greedy sample
    page.click('#tabs button[data-tab="playground"]')
    expect(page.locator(f'#play-model option[value="{trained["sampler"]}"]')).to_have_count(1)
    page.select_option("#play-model", trained["sampler"])
    page.select_option("#play-mode", "completion")
    page.fill("#play-max", "12")
    page.fill("#play-temp", "0")
    page.fill("#play-prompt", "Training loss goes down")  # the run learnt how TEXT goes on
    page.click("#play-form button[type=submit]")
    expect(page.locator("#play-out[data-done=true], #play-error:not(:empty)")).to_have_count(1)
    assert page.locator("#play-error").text_content() == ""
    tok = AutoTokenizer.from_pretrained(str(live.model_dir))
    ids = tok("Training loss goes down")["input_ids"]
    sampler = trained["sc"].create_sampling_client(model_path=trained["sampler"])
    seq = sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(
        max_tokens=12, temperature=0.0, stop=[tok.eos_token, "<|im_end|>"])).result().sequences[0]
    assert page.locator("#play-out").text_content() == tok.decode(seq.tokens, skip_special_tokens=True)
    page.screenshot(path=str(shots / "console-playground.png"), full_page=True)

    # engines and the queue
    page.click('#tabs button[data-tab="engines"]')
    engine = page.locator(f'#engines-table tbody tr[data-id="{MODEL}"]')
    expect(engine).to_contain_text("ready")
    expect(engine.locator("td").nth(2)).to_contain_text("%")  # utilisation measured between two refreshes
    page.screenshot(path=str(shots / "console-engines.png"), full_page=True)

    # deleting a checkpoint (after the confirmation)
    page.click('#tabs button[data-tab="runs"]')
    page.once("dialog", lambda d: d.accept())
    page.locator(f'#ckpt-table tbody tr[data-id="{trained["state"]}"] button.delete').click()
    expect(page.locator("#ckpt-table tbody tr")).to_have_count(1)
    with live.http() as http:
        paths = [c["tinker_path"] for c in http.get(f"/api/v1/training_runs/{trained['run']}/checkpoints")
                 .json()["checkpoints"]]
    assert paths == [trained["sampler"]], paths

    # bob sees none of it, and alice's data is refused to his key
    page.click("#signout")
    _sign_in(page, live.base_url, live.keys["bob"])
    expect(page.locator("#who")).to_contain_text("signed in as")
    expect(page.locator("#runs-empty")).to_be_visible()
    expect(page.locator("#runs-table tbody tr")).to_have_count(0)
    page.click('#tabs button[data-tab="samplers"]')
    expect(page.locator("#samplers-table tbody tr")).to_have_count(0)
    page.click('#tabs button[data-tab="playground"]')
    expect(page.locator("#play-model option")).to_have_count(1)  # the base model only
    status = page.evaluate("""async ([run, path]) => {
        const key = sessionStorage.getItem("ember.apiKey");
        const get = (u) => fetch(u, {headers: {"X-API-Key": key}}).then((r) => r.status);
        return [await get(`/console/api/training_runs/${encodeURIComponent(run)}/metrics`),
                await get(`/console/api/checkpoint_files?path=${encodeURIComponent(path)}`),
                await get(`/api/v1/training_runs/${encodeURIComponent(run)}/checkpoints`)];
    }""", [trained["run"], trained["sampler"]])
    assert status == [404, 404, 404], status
    page.click('#tabs button[data-tab="runs"]')
    page.screenshot(path=str(shots / "console-other-key.png"), full_page=True)
    assert not errors, errors
    context.close()
