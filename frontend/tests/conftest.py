from frontend.tests.browser import chromium, monkeypatch_module, page, site  # noqa: F401  (browser-test fixtures)
