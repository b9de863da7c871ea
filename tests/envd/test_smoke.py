import httpx


def test_health_is_204(envd_url):
    r = httpx.get(f"{envd_url}/health")
    assert r.status_code == 204
